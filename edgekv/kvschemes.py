"""KV cache schemes: what each stores per token, its bytes, and the numpy reference maths.

The exporter (torch, export/model.py) and the runtime (numpy, edgekv/cache.py) both read the
tensor layout from here, so a bundle's manifest, its graph and the runtime's buffers agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    suffix: str  # "" -> past.{i}.key ; "_scale" -> past.{i}.key_scale
    dtype: str  # "int8" | "float16" | "float" (the bundle's float dtype)
    rank: int  # 4: [P, B, Hkv, D]; 3: [P, B, Hkv]


@dataclass(frozen=True)
class KVScheme:
    name: str
    tensors: tuple[TensorSpec, ...]
    description: str
    min_scale: float = 0.0

    def names(self, layer: int, prefix: str) -> list[str]:
        """Graph I/O names of one layer, in graph order: key tensors, then value tensors."""
        return [f"{prefix}.{layer}.{kv}{t.suffix}" for kv in ("key", "value") for t in self.tensors]

    def bytes_per_token(self, n_layers: int, n_kv_heads: int, head_dim: int, float_bytes: int) -> int:
        per = 0
        for t in self.tensors:
            size = {"int8": 1, "float16": 2, "float": float_bytes}[t.dtype]
            per += size * n_kv_heads * (head_dim if t.rank == 4 else 1)
        return 2 * n_layers * per


# fp16's smallest normal number: a scale floor that keeps an all-zero row finite in fp16
_MIN_SCALE = 2.0 ** -14

SCHEMES = {
    "float": KVScheme("float", (TensorSpec("", "float", 4),), "unquantized reference (model float dtype)"),
    "int8": KVScheme(
        "int8",
        (TensorSpec("", "int8", 4), TensorSpec("_scale", "float16", 3)),
        "int8 values, one fp16 absmax/127 scale per (token, head), computed in the graph",
        min_scale=_MIN_SCALE,
    ),
    "int8-static": KVScheme(
        "int8-static",
        (TensorSpec("", "int8", 4),),
        "int8 values, one constant scale per (layer, KV head, channel) calibrated at export; no scale I/O",
        min_scale=_MIN_SCALE,
    ),
    "int8-tensor": KVScheme(
        "int8-tensor",
        (TensorSpec("", "int8", 4),),
        "int8 values, one constant scale per layer for K and one for V (127/max, the naive baseline)",
        min_scale=_MIN_SCALE,
    ),
}

STATIC = {"int8-static", "int8-tensor"}  # schemes whose scales are calibrated constants in the graph


def get_scheme(name: str) -> KVScheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise ValueError(f"unknown KV scheme {name!r}; known: {', '.join(SCHEMES)}") from None


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference per-(token, head) int8 quantization over the last axis. Returns (q, scale fp16)."""
    scale = np.maximum(np.abs(x).max(-1).astype(np.float32) / 127.0, _MIN_SCALE).astype(np.float16)
    q = np.clip(np.round(x / scale.astype(np.float32)[..., None]), -127, 127).astype(np.int8)
    return q, scale


def quantize_static(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Reference static quantization: `scale` broadcasts against x (per channel or per tensor)."""
    return np.clip(np.round(x / scale), -127, 127).astype(np.int8)


def float16_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int) -> int:
    """The yardstick every scheme's memory is compared with: an fp16 K and V cache."""
    return 2 * n_layers * n_kv_heads * head_dim * 2


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale.astype(np.float32)[..., None]
