"""Calibration at export, over calibration text run through the float model (K after RoPE):
- int8-static / int8-tensor (calibrate_static): per layer, K and V scales = channel absmax x a
  headroom, the headroom (and whether a window's first token counts for K) chosen by the
  attention output's error on held-out calibration windows. Absmax alone (kv_absmax +
  set_static_scales, the scales of bundles exported before) clips held-out text's larger values;
- int4: the mean key per layer, KV head and channel -> the offset subtracted before quantizing."""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from export.kv_torch import kv_quantize
from export.model import Transformer, causal_mask

# Default calibration text: docstrings of these stdlib modules. It ships with every Python, so
# export works offline, and it is *not* the default evaluation text (pydoc_data.topics), so the
# evaluation of int8-static measures calibration on different text, as a user would see it.
CALIBRATION_MODULES = ["argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal",
                       "email", "fractions", "functools", "http.client", "itertools", "json", "logging", "os",
                       "pathlib", "random", "re", "sqlite3", "statistics", "string", "subprocess", "tarfile",
                       "textwrap", "threading", "typing", "unittest", "urllib.request", "zipfile"]


def stdlib_docstrings() -> str:
    parts = []
    for name in CALIBRATION_MODULES:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and getattr(obj, "__module__", "") == mod.__name__:
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


def calibration_text(path: str | None) -> tuple[str, str]:
    if path:
        return Path(path).read_text(encoding="utf-8", errors="replace"), f"file {Path(path).name}"
    return stdlib_docstrings(), "docstrings of Python stdlib modules: " + ", ".join(CALIBRATION_MODULES)


@torch.no_grad()
def key_mean(model_float: Transformer, ids: list[int], window: int = 512) -> list[torch.Tensor]:
    """Per layer the mean key [Hkv, D] over every token of `ids` (after RoPE, before any rotation)."""
    cfg = model_float.cfg
    sums = [torch.zeros(cfg.n_kv_heads, cfg.head_dim, dtype=torch.float64) for _ in range(cfg.n_layers)]
    count = [0]

    def observer(i):
        def obs(k, v):  # [S, B, Hkv, D]
            sums[i] += k.double().sum((0, 1))
            if i == 0:
                count[0] += k.shape[0] * k.shape[1]
        return obs

    _run_observed(model_float, ids, window, observer)
    return [(s / max(count[0], 1)).float() for s in sums]


def _run_observed(model_float: Transformer, ids: list[int], window: int, observer) -> None:
    for i, layer in enumerate(model_float.layers):
        layer.attn.observer = observer(i)
    try:
        for start in range(0, len(ids), window):
            chunk = torch.tensor([ids[start: start + window]])
            s = chunk.shape[1]
            model_float(chunk, torch.arange(s)[None], causal_mask(0, s), torch.tensor([[s - 1]]),
                        *model_float.past_like(0, 1))
    finally:
        for layer in model_float.layers:
            layer.attn.observer = None


def set_key_offsets(model: Transformer, means: list[torch.Tensor]) -> None:
    """The offsets live where the keys are quantized: in the rotated basis when the scheme rotates
    (the mean of rotated keys is the rotated mean: rotation is linear)."""
    for layer, m in zip(model.layers, means):
        a = layer.attn
        a.k_offset.copy_(m @ a.had.float() if model.scheme.rotate else m)


@torch.no_grad()
def kv_absmax(model_float: Transformer, ids: list[int], window: int = 512) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_absmax [Hkv, D], v_absmax [Hkv, D]) over every token of `ids`: the previous
    int8-static calibration with set_static_scales (absmax/127), measured against calibrate_static
    in docs/kv-schemes.md."""
    cfg = model_float.cfg
    stats = [[torch.zeros(cfg.n_kv_heads, cfg.head_dim), torch.zeros(cfg.n_kv_heads, cfg.head_dim)]
             for _ in range(cfg.n_layers)]

    def observer(i):
        def obs(k, v):  # [S, B, Hkv, D]
            stats[i][0] = torch.maximum(stats[i][0], k.abs().amax((0, 1)).float())
            stats[i][1] = torch.maximum(stats[i][1], v.abs().amax((0, 1)).float())
        return obs

    _run_observed(model_float, ids, window, observer)
    return [tuple(x) for x in stats]


def set_static_scales(model: Transformer, stats, per_tensor: bool, min_scale: float) -> None:
    for layer, (k, v) in zip(model.layers, stats):
        for name, a in (("k_scale", k), ("v_scale", v)):
            a = torch.full_like(a, float(a.max())) if per_tensor else a
            getattr(layer.attn, name).copy_((a / 127.0).clamp(min=min_scale))


# --- int8-static / int8-tensor: scales chosen by the attention output's error on held-out text

# Headroom multipliers tried on the calibration absmax. Above 1: room for values larger than
# calibration saw (held-out text has them: its channel absmax exceeds 4,096 calibration tokens'
# by up to 2x in half the channels of SmolLM2); below 1: clip rare outliers for resolution.
HEADROOM = (0.7, 0.85, 1.0, 1.15, 1.3, 1.5, 1.75, 2.0, 2.5)
QUERY_ROWS = 64  # query rows per calibration window whose attention output is compared (its last ones)


@dataclass
class LayerWindow:
    """One layer's float attention on one calibration window: what the search re-runs."""
    args: tuple  # (x, cos, sin, rot, allowed) of the last QUERY_ROWS rows, as the layer received them
    k: torch.Tensor  # [S, 1, Hkv, D] keys after RoPE, every position of the window
    v: torch.Tensor  # [S, 1, Hkv, D]
    out: torch.Tensor  # [1, R, E] the float attention's output (after wo) on those rows


@torch.no_grad()
def attention_windows(model_float: Transformer, ids: list[int], window: int) -> list[list[LayerWindow]]:
    """Per layer, per calibration window of `window` tokens (from position 0, as a sequence starts,
    its first token an attention sink): the inputs and float output of the window's last rows."""
    per_layer = [[] for _ in model_float.layers]
    kv = {}

    def before(i):
        def hook(mod, args):
            x, cos, sin, rot, allowed = args[:5]
            s = x.shape[1]
            r0 = max(0, s - QUERY_ROWS)
            kv[i] = [(x[:, r0:], None if cos is None else cos[r0:], None if sin is None else sin[r0:], rot,
                      allowed[:, r0:, :])]
        return hook

    def after(i):
        def hook(mod, args, output):
            a = kv.pop(i)
            x = a[0][0]
            per_layer[i].append(LayerWindow(a[0], a[1], a[2], output[0][:, -x.shape[1]:].clone()))
        return hook

    def observer(i):
        def obs(k, v):  # [S, B, Hkv, D]
            kv[i].extend([k.clone(), v.clone()])
        return obs

    handles = []
    for i, layer in enumerate(model_float.layers):
        handles.append(layer.attn.register_forward_pre_hook(before(i)))
        handles.append(layer.attn.register_forward_hook(after(i)))
    try:
        _run_observed(model_float, ids, window, observer)
    finally:
        for h in handles:
            h.remove()
    return per_layer


def channel_absmax(windows: list[LayerWindow], skip_first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K absmax [Hkv, D], V absmax [Hkv, D]) over the windows' positions from skip_first on."""
    k = torch.stack([w.k[skip_first:].abs().amax((0, 1)) for w in windows]).amax(0)
    v = torch.stack([w.v[skip_first:].abs().amax((0, 1)) for w in windows]).amax(0)
    return k, v


@torch.no_grad()
def output_error(attn, scheme, w: LayerWindow, k_scale: torch.Tensor, v_scale: torch.Tensor) -> float:
    """Squared error of the layer's attention output (after wo) on w's query rows when its K/V
    cache is int8 with these scales, against the float output. `attn` is the static-scheme
    layer itself: the error is that of the graph's own maths (RoPE, norms, GQA, clamp)."""
    x = w.args[0]
    p = w.k.shape[0] - x.shape[1]  # the rows before the query rows are the past, stored quantized
    past = ([kv_quantize(scheme, w.k[:p], k_scale)[0][0]], [kv_quantize(scheme, w.v[:p], v_scale)[0][0]])
    attn.k_scale.copy_(k_scale)
    attn.v_scale.copy_(v_scale)
    out, _ = attn(*w.args, past, scheme)
    return float(((out - w.out) ** 2).sum())


def per_tensor_max(a: torch.Tensor) -> torch.Tensor:
    return torch.full_like(a, float(a.max()))


@torch.no_grad()
def search_layer(attn, scheme, windows: list[LayerWindow]) -> dict:
    """The headroom (and whether the first token's keys count) for one layer, chosen by the output
    error on held-out windows: two folds, statistics from the even windows scored on the odd ones
    and back, so a choice pays for clipping values the statistics never saw. K and V in turn
    (V with the K scale at absmax, then K with the chosen V)."""
    folds = [(windows[0::2], windows[1::2]), (windows[1::2], windows[0::2])]
    fit = scale_fit(scheme)
    stats = [(channel_absmax(a, 0), channel_absmax(a, 1), b) for a, b in folds if b]

    def err(k_of, v_of):
        return sum(output_error(attn, scheme, w, fit(k_of(full, nosink)), fit(v_of(full, nosink)))
                   for full, nosink, held in stats for w in held) if stats else 0.0

    def scaled(alpha, which, sink=True):
        return lambda full, nosink: alpha * (full if sink else nosink)[which] / 127.0

    errs_v = {a: err(scaled(1.0, 0), scaled(a, 1)) for a in HEADROOM}
    av = min(errs_v, key=errs_v.get)
    # leaving the first token out changes nothing where it never sets a channel's absmax: not tried
    sinks = (True, False) if any(not torch.equal(full[0], nosink[0]) for full, nosink, _ in stats) else (True,)
    errs_k = {(a, s): err(scaled(a, 0, s), scaled(av, 1)) for a in HEADROOM for s in sinks}
    ak, sink = min(errs_k, key=errs_k.get)
    return {"k_headroom": ak, "v_headroom": av, "k_counts_first_token": sink,
            "errors_k": {f"{a}{'' if s else '-nosink'}": e for (a, s), e in errs_k.items()}, "errors_v": errs_v}


def scale_fit(scheme):
    """Calibrated magnitude [Hkv, D] -> the scale the scheme stores: per channel, or the layer's max."""
    def fit(a):
        a = per_tensor_max(a) if scheme.per_tensor else a
        return a.clamp(min=scheme.min_scale)
    return fit


@torch.no_grad()
def calibrate_static(model: Transformer, model_float: Transformer, ids: list[int], window: int = 1024) -> dict:
    """Set every layer's int8 K and V scales: absmax over all calibration tokens (the first token
    of each window left out of K where the search says so) times the headroom the output-error
    search chose for that layer. Returns the manifest's account of it."""
    scheme = model.scheme
    window = min(window, len(ids) // 4)  # at least four windows: two folds of two
    samples = attention_windows(model_float, ids, window)
    fit = scale_fit(scheme)
    chosen = []
    for layer, wins in zip(model.layers, samples):
        a = layer.attn
        factored, a.factored = a.factored, False  # the generic path: same maths, no block-diagonal work
        try:
            c = search_layer(a, scheme, wins)
        finally:
            a.factored = factored
        k_all, _ = channel_absmax(wins, 0 if c["k_counts_first_token"] else 1)
        _, v_all = channel_absmax(wins, 0)  # the first token's values always count (the search tries keys only)
        a.k_scale.copy_(fit(c["k_headroom"] * k_all / 127.0))
        a.v_scale.copy_(fit(c["v_headroom"] * v_all / 127.0))
        chosen.append(c)
    return {"method": ("per layer for K and for V: " if scheme.per_tensor else "per (layer, KV head, channel): ")
                      + "absmax/127 x a headroom chosen per layer from " + ", ".join(map(str, HEADROOM))
                      + " by the attention output's error (after wo) on held-out calibration windows (2 folds), "
                        "the first token's keys counted or not by the same error; K after RoPE",
            "window": window,
            "k_headroom": [c["k_headroom"] for c in chosen], "v_headroom": [c["v_headroom"] for c in chosen],
            "k_first_token_counted": [c["k_counts_first_token"] for c in chosen]}
