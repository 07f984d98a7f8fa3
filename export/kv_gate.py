"""The held-out check of a calibrated static int8 cache: perplexity with its scales against a
float cache with the same weights, on text the calibration never saw (the stdlib's pydoc topics;
the calibration reads other modules' docstrings). `edgekv export`'s default `--kv auto` keeps
int8-static (the scheme onnxruntime's fused attention runs, docs/fused.md) where the check holds
and falls back to per-token int8 where it does not; an explicit `--kv int8-static` is kept either
way, the check recorded and said."""
from __future__ import annotations

import math

import torch

from export.model import Transformer, causal_mask

AUTO = "auto"  # `edgekv export --kv auto`: one of the two below, by the check
AUTO_CHOICES = ("int8-static", "int8")  # what auto tries first, what it falls back to
BAR = 0.003  # relative ΔPPL against a float cache: int8 per token measures -0.20..+0.13 % (docs/kv-schemes.md)
HELD_OUT_TOKENS = 1024
WINDOW = 512  # each window from position 0, as a sequence starts


def held_out_ids(tokenizer_json: str, n: int = HELD_OUT_TOKENS) -> tuple[list[int], str]:
    """The first n tokens of `edgekv eval`'s default text (export/calibrate.py never reads it)."""
    from tokenizers import Tokenizer

    from edgekv.tools.corpus import default_text

    text, desc = default_text()
    return Tokenizer.from_str(tokenizer_json).encode(text, add_special_tokens=False).ids[:n], desc.split(" (")[0]


@torch.no_grad()
def mean_nll(model: Transformer, ids: list[int], window: int = WINDOW) -> float:
    """Mean next-token negative log-likelihood over `ids` in windows (a window's every position
    scored; K/V pass through the scheme's quantizer before attention, as the cache stores them)."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start: start + window + 1]
        s = len(chunk) - 1
        if s < 1:
            break
        x = torch.tensor([chunk[:-1]])
        logits = model(x, torch.arange(s)[None], causal_mask(0, s), torch.arange(s)[None], *model.past_like(0, 1))[0]
        logp = torch.log_softmax(logits[0].double(), -1)
        total -= float(logp[torch.arange(s), torch.tensor(chunk[1:])].sum())
        count += s
    return total / max(count, 1)


def held_out_check(model: Transformer, reference: Transformer, tokenizer_json: str, context: int) -> dict:
    """The manifest's record of the check: perplexities, ΔPPL relative, the bar and the verdict.
    Windows stay within the bundle's context (the positions it is verified for)."""
    ids, desc = held_out_ids(tokenizer_json)
    window = min(WINDOW, context)
    ppl_float, ppl = math.exp(mean_nll(reference, ids, window)), math.exp(mean_nll(model, ids, window))
    delta = ppl / ppl_float - 1.0
    return {"text": desc, "tokens": len(ids), "ppl_float_cache": round(ppl_float, 6), "ppl": round(ppl, 6),
            "window": window, "delta_ppl": round(delta, 6), "bar": BAR, "passed": bool(delta <= BAR)}


def verdict_line(kv: str, check: dict) -> str:
    d = f"ΔPPL {100 * check['delta_ppl']:+.3f} % vs a float cache on {check['tokens']} tokens of {check['text']}"
    if check["passed"]:
        return f"  held-out check: {d} (bar {100 * BAR:.1f} %): {AUTO_CHOICES[0] if kv == AUTO else kv} kept"
    if kv == AUTO:
        return f"  held-out check: {d}, above the {100 * BAR:.1f} % bar: exporting per-token int8 instead"
    return f"  held-out check: {d}, above the {100 * BAR:.1f} % bar (kept: --kv {kv} was asked for)"
