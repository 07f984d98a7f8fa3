"""Sampling: greedy, temperature, top-k, top-p, repetition penalty."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # 0: off
    seed: int | None = None


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator, history: list[int]) -> int:
    if p.repeat_penalty != 1.0 and history and p.repeat_last_n > 0:  # history[-0:] would be all of it
        logits = logits.copy()
        recent = np.unique(np.asarray(history[-p.repeat_last_n:], np.int64))
        vals = logits[recent]
        logits[recent] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
    if p.temperature <= 0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / p.temperature
    if p.top_k and p.top_k < x.shape[0]:
        kth = np.partition(x, -p.top_k)[-p.top_k]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs)
        cum = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cum, p.top_p)) + 1]  # smallest set with mass >= top_p
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return int(rng.choice(probs.shape[0], p=probs))


def sampling_from(args) -> SamplingParams:
    """The sampling options of `edgekv generate` and `edgekv chat`."""
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed)
