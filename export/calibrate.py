"""Calibration at export, over calibration text run through the float model (K after RoPE):
- int8-static / int8-tensor: absmax of K and V per layer, KV head and channel -> scales;
- int4: the mean key per layer, KV head and channel -> the offset subtracted before quantizing."""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import torch

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
    """Per layer (k_absmax [Hkv, D], v_absmax [Hkv, D]) over every token of `ids`."""
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
