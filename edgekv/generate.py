"""Generation: chunked prefill, decode steps, sampling."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from edgekv.cache import KVCache
from edgekv.errors import EdgeKVError


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # 0: off
    seed: int | None = None


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # prompt in -> first token out
    prefill_s: float = 0.0
    decode_s: float = 0.0  # after the first token (which comes from the prefill)
    decode_steps: int = 0  # decode calls timed in decode_s; each makes one token (a stop token too)
    stop_reason: str = ""

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


class Generator:
    def __init__(self, backend, cache: KVCache, prefill_chunk: int = 256):
        self.backend, self.cache = backend, cache
        # a TensorRT engine takes at most its profile's max_prefill tokens per call
        self.prefill_chunk = min(prefill_chunk, getattr(backend, "max_prefill", prefill_chunk))
        self.pos = 0  # next RoPE position (equals cache.n for a linear cache)
        self._one = np.zeros((1, 1), np.int64)
        self._pos1 = np.zeros((1, 1), np.int64)
        self._idx0 = np.zeros((1, 1), np.int64)

    def reset(self) -> None:
        self.cache.reset()
        self.pos = 0

    def truncate(self, n: int) -> None:
        self.cache.truncate(n)
        self.pos = n

    def prefill(self, ids: list[int], all_logits: bool = False, logits_from: int = 0) -> np.ndarray:
        """Feed ids in chunks; return the last token's logits [V], or with all_logits those of
        every token from index `logits_from` on [S - logits_from, V] (the head runs only there)."""
        if not ids:
            raise EdgeKVError("empty prompt: nothing to feed the model")
        self.cache.check_room(len(ids))  # the whole prompt, before any of it is fed
        out = []
        last = None
        start = 0
        while start < len(ids):
            # a ring cache takes a call only up to the end of its buffer
            step = min(self.prefill_chunk, self.cache.max_write())
            chunk = np.asarray(ids[start: start + step], np.int64)[None]  # [1, S]
            s = chunk.shape[1]
            pos = np.arange(self.pos, self.pos + s, dtype=np.int64)[None]
            first = max(0, logits_from - start)  # rows of this chunk that are wanted
            wanted = all_logits and first < s
            idx = (np.arange(first, s) if wanted else np.array([s - 1]))[None].astype(np.int64)
            logits = self.backend.run(chunk, pos, idx, self.cache)
            self.pos += s
            start += s
            if wanted:
                out.append(logits[0].copy())
            else:
                last = logits[0, -1]
        return np.concatenate(out) if all_logits else last

    def decode_step(self, token: int) -> np.ndarray:
        """One token in, its logits [V] out (a view; valid until the next call)."""
        self._one[0, 0] = token
        self._pos1[0, 0] = self.pos
        logits = self.backend.run(self._one, self._pos1, self._idx0, self.cache)
        self.pos += 1
        return logits[0, 0]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                 stop_ids: set[int], stats: Stats | None = None, history: list[int] | None = None):
        """Prefill the prompt, then yield new token ids (see `decode`)."""
        stats = stats if stats is not None else Stats()
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids)
        stats.prompt_tokens = len(prompt_ids)
        stats.prefill_s = time.perf_counter() - t0
        yield from self.decode(logits, max_new_tokens, params, np.random.default_rng(params.seed), stop_ids,
                               list(history or []) + list(prompt_ids), stats, t0)

    def decode(self, logits: np.ndarray, max_new_tokens: int, params: SamplingParams, rng: np.random.Generator,
               stop_ids: set[int], history: list[int], stats: Stats, t0: float, room=None,
               keep_turn: bool = False, on_fed=lambda tok: None):
        """The decode loop: sample from `logits` on and yield each new token id before it is fed.
        Stops at a stop token (not yielded), max_new_tokens, or when `room()` (default: the
        cache's) runs out. keep_turn (chat): the stop token and the last token are fed too, so the
        cache holds the whole turn the way the template renders it. on_fed(tok) is called once a
        token is in the cache (an interrupt in between leaves it out of both)."""
        room = room or self.cache.room
        t_first = None
        for i in range(max_new_tokens):
            tok = sample(logits, params, rng, history)
            if t_first is None:
                t_first = time.perf_counter()
                stats.ttft_s = t_first - t0
            if tok in stop_ids:
                stats.stop_reason = "stop"
                if keep_turn and room() > 0:
                    self.decode_step(tok)
                    on_fed(tok)
                return
            stats.new_tokens += 1
            history.append(tok)
            yield tok
            if i == max_new_tokens - 1 and not keep_turn:
                break
            if room() < 1:
                stats.stop_reason = "context"
                return
            logits = self.decode_step(tok)
            on_fed(tok)
            stats.decode_steps += 1
            stats.decode_s = time.perf_counter() - t_first
        stats.stop_reason = "length"


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
