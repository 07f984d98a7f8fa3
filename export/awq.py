"""Activation-aware scales for weights requantized to INT4 (AWQ: Lin et al., 2023).

A matrix W [N, K] fed by x computes W x = (W diag(s)) (x / s). Input channels that carry large
activations matter most to the output; giving them s > 1 before quantizing puts their weights on
a finer grid relative to the group's absmax, and 1/s folds exactly into what produces x:

- q|k|v and gate|up: the RMSNorm weight before them (a float vector in the graph);
- down: the up rows of gate|up (a row scale leaves per-row group quantization unchanged).

o is left alone: its input is the attention output of values that the int8 KV cache quantizes
per (token, head), so scaling them would move error into the cache.

s = a^alpha (a: mean |x| per input channel on the calibration text), normalized to a geometric
mean of 1, with alpha in 0, 0.1, ..., 1 chosen per matrix by the output error on calibration rows;
alpha = 0 (no scaling) is one of the candidates, so a matrix is left unscaled where scaling does
not help there. Each group's clip ratio is chosen by the same output error (AWQ's clip search)
rather than the weights' own error. What it gives on held-out text: docs/weights.md."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from export.model import Transformer, causal_mask
from export.weights import int4_groups

ALPHAS = tuple(round(a, 1) for a in np.arange(0.0, 1.01, 0.1))
SCALED = ("attn.wqkv", "mlp.w_gate_up", "mlp.w_down")  # per layer; see above for o


@torch.no_grad()
def activation_stats(model_float: Transformer, ids: list[int], window: int = 512, rows: int = 64,
                     seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """weight name -> (mean |x| per input channel [K], calibration rows [R, K]) for every matrix
    in SCALED, from the float model over `ids` (`rows` random positions per window kept)."""
    rng = np.random.default_rng(seed)
    sums: dict[str, np.ndarray] = {}
    samples: dict[str, list[np.ndarray]] = {}
    count = [0]
    pick = [np.zeros(0, np.int64)]
    hooks = []

    def hook(name):
        def pre(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double().numpy()  # [S, K]
            sums[name] = sums.get(name, 0) + np.abs(x).sum(0)
            samples.setdefault(name, []).append(x[pick[0]].astype(np.float32))
        return pre

    for i, layer in enumerate(model_float.layers):
        for part in SCALED:
            hooks.append(layer.get_submodule(part).register_forward_pre_hook(hook(f"layers.{i}.{part}.weight")))
    try:
        for start in range(0, len(ids), window):
            chunk = torch.tensor([ids[start: start + window]])
            s = chunk.shape[1]
            pick[0] = rng.choice(s, size=min(rows, s), replace=False)
            count[0] += s
            model_float(chunk, torch.arange(s)[None], causal_mask(0, s), torch.tensor([[s - 1]]),
                        *model_float.past_like(0, 1))
    finally:
        for h in hooks:
            h.remove()
    return {name: (sums[name] / count[0], np.concatenate(samples[name])) for name in sums}


def best_scale(w: np.ndarray, mean_abs: np.ndarray, x: np.ndarray, group: int, search: bool):
    """(s [K], alpha, the QuantWeight of W diag(s), output error at alpha 0, at the chosen alpha)
    for W [N, K]. Each candidate's groups take the clip ratio that minimizes their share of the
    output error on the calibration rows (AWQ's clip search), not the weights' own error."""
    if w.shape[1] % group:
        raise ValueError(f"--group {group} does not divide a matrix's input size {w.shape[1]}")
    w = w.astype(np.float32)
    ref = x @ w.T
    a = np.maximum(mean_abs, 1e-8)
    best = None
    for alpha in ALPHAS:
        s = (a ** alpha).astype(np.float32)
        s /= np.sqrt(s.max() * s.min())
        xs = (x / s[None, :]).reshape(len(x), -1, group)  # the scaled matrix's inputs, by group
        q = int4_groups(w * s[None, :], group, search, np.einsum("rgi,rgj->gij", xs, xs, optimize=True))
        err = float(((x @ (q.dequantize() / s[None, :]).T - ref) ** 2).sum())
        if alpha == 0.0:
            err0 = err
        if best is None or err < best[3]:
            best = (s, alpha, q, err)
    return best[0], best[1], best[2], err0, best[3]


def apply_awq(state: dict[str, np.ndarray], norms: dict[str, np.ndarray], stats: dict, inter: int,
              group: int, search: bool) -> tuple[dict, dict, dict, dict]:
    """Scale every matrix in `stats` and fold 1/s where its input comes from. state: name -> float
    W [N, K]; norms: RMSNorm name -> weight [K]. Returns the new (state, norms), the matrices'
    QuantWeights (of the scaled values, folds included) and a report: name -> alpha and the
    output error against no scaling."""
    state, norms = dict(state), dict(norms)
    report, quant, scales = {}, {}, {}
    for name, (mean_abs, x) in stats.items():
        s, alpha, q, err0, err = best_scale(state[name], mean_abs, x, group, search)
        report[name] = {"alpha": alpha, "error_ratio": err / err0 if err0 > 0 else 1.0}
        quant[name], scales[name] = replace(q, origin=q.origin + ", AWQ scales"), s
        state[name] = state[name] * s[None, :]
    for name, s in scales.items():  # the folds; a row scale moves a row's group scales with it
        layer = name.rsplit(".", 3)[0]  # layers.i
        if name.endswith("attn.wqkv.weight"):
            norms[f"{layer}.attn_norm.weight"] = norms[f"{layer}.attn_norm.weight"] / s
        elif name.endswith("mlp.w_gate_up.weight"):
            norms[f"{layer}.mlp_norm.weight"] = norms[f"{layer}.mlp_norm.weight"] / s
        else:  # w_down: its input is silu(gate) * up, linear in the up rows
            gu = f"{layer}.mlp.w_gate_up.weight"
            w = state[gu].copy()
            w[inter:] /= s[:, None]
            state[gu] = w
            if gu in quant:
                gs = quant[gu].scales.copy()
                gs[inter:] /= s[:, None]
                quant[gu] = replace(quant[gu], scales=gs)
    return state, norms, quant, report
