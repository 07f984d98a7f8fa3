"""KV cache schemes: what each stores per token, its bytes, and the numpy reference maths.

The exporter (torch, export/model.py) and the runtime (numpy, edgekv/runtime/cache.py) both
read the tensor layout from here, so a bundle's manifest, its graph and the runtime's buffers
agree. Each scheme says what kind it is (`kind`, one of KINDS): code that treats kinds
differently asks that, never a scheme's name.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


INT4_GROUP = 32  # int4 scales: one per 32 channels of a head

# The 16 int4 levels, in units of the group's absmax (the scale). Not uniform: after the Hadamard
# rotation K/V values are roughly Gaussian, so most of them sit near 0, and the levels are placed
# where the values are (Lloyd-Max: 1-D k-means of absmax-normalized, rotated K and V of SmolLM2,
# symmetric, ends pinned at ±1; what they buy is in docs/kv-schemes.md). Part of the format: a
# stored code c means INT4_LEVELS[c] * scale.
INT4_LEVELS = (-1.0, -0.807, -0.653, -0.521, -0.399, -0.282, -0.168, -0.056,
               0.056, 0.168, 0.282, 0.399, 0.521, 0.653, 0.807, 1.0)
# a value goes to the nearest level: code = how many midpoints it lies above
INT4_THRESHOLDS = tuple((a + b) / 2 for a, b in zip(INT4_LEVELS[:-1], INT4_LEVELS[1:]))


@dataclass(frozen=True)
class TensorSpec:
    suffix: str  # "" -> past.{i}.key ; "_scale" -> past.{i}.key_scale
    dtype: str  # "int8" | "uint8" | "float16" | "float" (the bundle's float dtype)
    last: str  # last dim: "D" [P,B,Hkv,D] | "D/2" packed int4 | "G" groups | "" for [P,B,Hkv]

    @property
    def rank(self) -> int:
        return 4 if self.last else 3

    def last_dim(self, head_dim: int) -> int | None:
        return {"D": head_dim, "D/2": head_dim // 2, "G": n_groups(head_dim), "": None}[self.last]

    def shape(self, slots: int, batch: int, n_kv_heads: int, head_dim: int) -> tuple:
        d = self.last_dim(head_dim)
        return (slots, batch, n_kv_heads) + ((d,) if d else ())


def n_groups(head_dim: int) -> int:
    return max(1, head_dim // INT4_GROUP)


# what a scheme stores, by kind:
#   float    the K/V values in the model's float dtype
#   dynamic  int8 values and a scale per (token, head) computed in the graph
#   static   int8 values with calibrated constant scales in the graph (no scale I/O)
#   packed4  4-bit codes packed two per byte and a scale per group of channels
KINDS = ("float", "dynamic", "static", "packed4")


@dataclass(frozen=True)
class KVScheme:
    name: str
    kind: str  # one of KINDS
    tensors: tuple[TensorSpec, ...]
    description: str
    min_scale: float = 0.0
    per_tensor: bool = False  # static: one scale per layer for K and one for V (else per channel)
    rotate: bool = False  # int4: a fixed orthogonal (Hadamard) rotation of q/k and v before quantizing
    center_keys: bool = False  # int4: subtract a calibrated per-channel key offset before quantizing

    def names(self, layer: int, prefix: str) -> list[str]:
        """Graph I/O names of one layer, in graph order: key tensors, then value tensors."""
        return [f"{prefix}.{layer}.{kv}{t.suffix}" for kv in ("key", "value") for t in self.tensors]

    def spec_of(self, name: str) -> TensorSpec:
        """The tensor spec behind a graph I/O name (past.3.key_scale -> the scale spec)."""
        for t in self.tensors[1:]:  # the values' tensor has no suffix; the others are named by theirs
            if name.endswith(t.suffix):
                return t
        return self.tensors[0]

    def bytes_per_token(self, n_layers: int, n_kv_heads: int, head_dim: int, float_bytes: int) -> int:
        per = 0
        for t in self.tensors:
            size = {"int8": 1, "uint8": 1, "float16": 2, "float": float_bytes}[t.dtype]
            per += size * n_kv_heads * (t.last_dim(head_dim) or 1)
        return 2 * n_layers * per


# fp16's smallest normal number: a scale floor that keeps an all-zero row finite in fp16
_MIN_SCALE = 2.0 ** -14

SCHEMES = {
    "float": KVScheme("float", "float", (TensorSpec("", "float", "D"),), "unquantized reference (model float dtype)"),
    "int8": KVScheme(
        "int8", "dynamic",
        (TensorSpec("", "int8", "D"), TensorSpec("_scale", "float16", "")),
        "int8 values, one fp16 absmax/127 scale per (token, head), computed in the graph",
        min_scale=_MIN_SCALE,
    ),
    "int8-static": KVScheme(
        "int8-static", "static",
        (TensorSpec("", "int8", "D"),),
        "int8 values, one constant scale per (layer, KV head, channel) calibrated at export; no scale I/O",
        min_scale=_MIN_SCALE,
    ),
    "int8-tensor": KVScheme(
        "int8-tensor", "static",
        (TensorSpec("", "int8", "D"),),
        "int8 values, one constant scale per layer for K and one for V (127/max, the naive baseline)",
        min_scale=_MIN_SCALE, per_tensor=True,
    ),
    "int4": KVScheme(
        "int4", "packed4",
        (TensorSpec("", "uint8", "D/2"), TensorSpec("_scale", "float16", "G")),
        f"4-bit codes packed two per byte (uint8 I/O) on 16 non-uniform levels, fp16 absmax scale per (token, head, "
        f"{INT4_GROUP} channels), after a fixed Hadamard rotation that spreads outlier channels; keys centered by a "
        "calibrated per-channel offset (softmax-invariant, never added back)",
        min_scale=_MIN_SCALE, rotate=True, center_keys=True,
    ),
    "int4-norot": KVScheme(
        "int4-norot", "packed4",
        (TensorSpec("", "uint8", "D/2"), TensorSpec("_scale", "float16", "G")),
        "int4 like `int4` but without the rotation (to show what the rotation buys)",
        min_scale=_MIN_SCALE, center_keys=True,
    ),
}

assert all(s.kind in KINDS for s in SCHEMES.values())


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


def quantize_int4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference int4: groups of INT4_GROUP channels, fp16 absmax scale, each value coded as the
    nearest of INT4_LEVELS (times the scale); codes 0..15 two per byte (even channel low nibble)."""
    d = x.shape[-1]
    g = n_groups(d)
    xg = x.reshape(*x.shape[:-1], g, d // g)
    scale = np.maximum(np.abs(xg).max(-1).astype(np.float32), _MIN_SCALE).astype(np.float16)
    y = xg / scale.astype(np.float32)[..., None]
    codes = (y[..., None] > np.asarray(INT4_THRESHOLDS, np.float32)).sum(-1).reshape(x.shape)
    return pack_int4(codes), scale


def pack_int4(codes: np.ndarray) -> np.ndarray:
    u = codes.astype(np.uint8)  # [.., D] in 0..15
    return (u[..., 0::2] + 16 * u[..., 1::2]).astype(np.uint8)


def unpack_int4(b: np.ndarray) -> np.ndarray:
    """Bytes [.., D/2] -> codes [.., D] in 0..15."""
    b = b.astype(np.int16)
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.int16)
    out[..., 0::2], out[..., 1::2] = b % 16, b // 16
    return out.astype(np.uint8)


def dequantize_int4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    v = np.asarray(INT4_LEVELS, np.float32)[unpack_int4(packed)]
    d = v.shape[-1]
    g = scale.shape[-1]
    return (v.reshape(*v.shape[:-1], g, d // g) * scale.astype(np.float32)[..., None]).reshape(v.shape)


def int4_byte_table() -> np.ndarray:
    """[256, 2]: byte -> (level of its low nibble, level of its high nibble). The graph decodes the
    packed cache with one Gather on this table (TensorRT's parser has no bitwise ops)."""
    lv = np.asarray(INT4_LEVELS, np.float32)
    b = np.arange(256)
    return np.stack([lv[b % 16], lv[b // 16]], -1)


def hadamard(d: int) -> np.ndarray:
    """A fixed orthonormal rotation: Sylvester's Hadamard matrix / sqrt(d) for d a power of two,
    else a seeded random orthogonal matrix."""
    if d & (d - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        return (h / np.sqrt(d)).astype(np.float32)
    q, r = np.linalg.qr(np.random.default_rng(0).standard_normal((d, d)))
    return (q * np.sign(np.diag(r))).astype(np.float32)


def float16_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int) -> int:
    """The yardstick every scheme's memory is compared with: an fp16 K and V cache."""
    return 2 * n_layers * n_kv_heads * head_dim * 2


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale.astype(np.float32)[..., None]
