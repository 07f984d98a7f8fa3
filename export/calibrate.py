"""Calibration of the static int8 schemes: absmax of K (after RoPE) and V per layer, KV head and
channel, over calibration text run through the float model."""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import torch

from export.model import Transformer

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

    for i, layer in enumerate(model_float.layers):
        layer.attn.observer = observer(i)
    try:
        for start in range(0, len(ids), window):
            chunk = torch.tensor([ids[start: start + window]])
            s = chunk.shape[1]
            model_float(chunk, torch.arange(s)[None], torch.ones(1, s, dtype=torch.bool), torch.tensor([[s - 1]]),
                        *model_float.past_like(0, 1))
    finally:
        for layer in model_float.layers:
            layer.attn.observer = None
    return [tuple(x) for x in stats]


def set_static_scales(model: Transformer, stats, per_tensor: bool, min_scale: float) -> None:
    for layer, (k, v) in zip(model.layers, stats):
        for name, a in (("k_scale", k), ("v_scale", v)):
            a = torch.full_like(a, float(a.max())) if per_tensor else a
            getattr(layer.attn, name).copy_((a / 127.0).clamp(min=min_scale))
