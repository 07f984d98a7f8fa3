"""GGUF block types decoded to integer codes and exact float32 block scales (and minimums).

Each decoder takes a tensor's raw bytes [N, bytes per row] and returns, per matrix W [N, K]:
  codes [N, K] int8, scales [N, K/B] float32, B, mins [N, K/B] float32 or None,
with W = codes * scale + min per block, exactly the values llama.cpp (and the gguf package's
dequantize) compute. The layouts follow ggml-quants.c / gguf-py's quants.py; the tests hold the
result to `gguf.quants.dequantize` bit for bit. Every stored scale is a float32 product of an
fp16 and a small integer (d·sc: at most 11 + 7 significant bits), so it is exact; `exact_product`
checks it rather than trusting it.

The scales of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are the file's fp16 fields widened (HALF_SCALES): the
bundle stores them as fp16 again (export/weights.py: `QuantWeight.half_scales`).

Codes keep the file's unsigned values where an 8-bit carrier holds them as they are (Q5_1, Q5_K:
0..31 with their minimum), and are made signed where the file's own formula subtracts an offset
(Q4_0: q - 8, Q5_0: q - 16, Q6_K: q - 32). Q4_1 and Q4_K (unsigned 0..15 with a minimum) are
returned unsigned too; the INT4 carrier shifts them (export/weights.py: `QuantWeight.shift`).
"""
from __future__ import annotations

import numpy as np

QK_K = 256  # K-quant super-block


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block, as float32 [blocks]."""
    return raw[:, at:at + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def exact_product(d: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """d [blocks] (from fp16) times the integer sub-block scales sc [blocks, S], in float32,
    checked to be the exact product (float64 holds it exactly)."""
    exact = d.astype(np.float64)[:, None] * sc.astype(np.float64)
    out = exact.astype(np.float32)
    if not np.array_equal(out.astype(np.float64), exact, equal_nan=True):
        raise ValueError("a block scale d·sc is not exact in float32")  # cannot happen for fp16 x 8-bit
    return out


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per 32 weights: weight j in the low nibble of byte j, weight j+16 in the high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4-byte little-endian mask: bit j is weight j's fifth bit. [blocks, 32]"""
    return np.unpackbits(qh, axis=1, bitorder="little")


def q8_0(raw):  # d f16, 32 x int8
    return raw[:, 2:].copy().view(np.int8), _f16(raw, 0)[:, None], 32, None


def q4_0(raw):  # d f16, 16 bytes of nibbles; w = d (q - 8)
    return _nibbles(raw[:, 2:]).astype(np.int8) - 8, _f16(raw, 0)[:, None], 32, None


def q4_1(raw):  # d f16, m f16, nibbles; w = d q + m
    return _nibbles(raw[:, 4:]).astype(np.int8), _f16(raw, 0)[:, None], 32, _f16(raw, 2)[:, None]


def q5_0(raw):  # d f16, qh 4 bytes, nibbles; w = d (q - 16)
    q = _nibbles(raw[:, 6:]) | (_high_bits_32(raw[:, 2:6]) << 4)
    return q.astype(np.int8) - 16, _f16(raw, 0)[:, None], 32, None


def q5_1(raw):  # d f16, m f16, qh 4 bytes, nibbles; w = d q + m
    q = _nibbles(raw[:, 8:]) | (_high_bits_32(raw[:, 4:8]) << 4)
    return q.astype(np.int8), _f16(raw, 0)[:, None], 32, _f16(raw, 2)[:, None]


def k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins [blocks, 8] (sub-block j:
    j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 split over byte j + 4's nibbles and the
    top two bits of bytes j - 4 and j)."""
    s = s.astype(np.uint8)
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes per 256 weights: four chunks of 32 bytes; chunk c's low nibbles are sub-block 2c,
    its high nibbles sub-block 2c + 1. [blocks, 256]"""
    n = qs.shape[0]
    ch = qs.reshape(n, 4, 1, 32)
    return np.concatenate([ch & 0x0F, ch >> 4], axis=2).reshape(n, QK_K)


def _k_fields(kind: str, raw: np.ndarray):
    """A K-quant block's scale fields as the file stores them: (d [blocks] of fp16, sc [blocks, S]
    int8, dmin, mn); Q6_K (int8 scales, d last) has no minimum: dmin, mn None."""
    if kind == "Q6_K":
        return _f16(raw, 208), raw[:, 192:208].copy().view(np.int8), None, None
    sc, mn = k_scale_min(raw[:, 4:16])
    return _f16(raw, 0), sc.astype(np.int8), _f16(raw, 2), mn.astype(np.int8)


def q4_k(raw):  # d, dmin f16, 12 bytes scales/mins, 128 bytes nibbles; w = d sc q - dmin m per 32
    d, sc, dmin, mn = _k_fields("Q4_K", raw)
    q = _k_low_nibbles(raw[:, 16:144])
    return q.astype(np.int8), exact_product(d, sc), 32, -exact_product(dmin, mn)


def q5_k(raw):  # d, dmin, 12 bytes scales/mins, qh 32 bytes (bit j of byte i: sub-block j), 128 bytes nibbles
    n = raw.shape[0]
    d, sc, dmin, mn = _k_fields("Q5_K", raw)
    qh = raw[:, 16:48]
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [blocks, 8, 32]
    q = _k_low_nibbles(raw[:, 48:176]) | (high.reshape(n, QK_K) << 4)
    return q.astype(np.int8), exact_product(d, sc), 32, -exact_product(dmin, mn)


def q6_k(raw):  # ql 128, qh 64, 16 x int8 scales, d f16 (last); w = d sc (q - 32) per 16
    n = raw.shape[0]
    ql = raw[:, :128].reshape(n, 2, 1, 64)  # two halves of 128 weights
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)
    qh = raw[:, 128:192].reshape(n, 2, 1, 32)
    high = ((qh >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3)  # [blocks, 2, 4, 32]
    q = (low | (high << 4)).reshape(n, QK_K).astype(np.int8) - 32
    d, sc, _, _ = _k_fields("Q6_K", raw)
    return q, exact_product(d, sc), 16, None


# type -> (decoder, weights per block in the file, bytes per block)
DECODERS = {
    "Q8_0": (q8_0, 32, 34), "Q4_0": (q4_0, 32, 18), "Q4_1": (q4_1, 32, 20),
    "Q5_0": (q5_0, 32, 22), "Q5_1": (q5_1, 32, 24),
    "Q4_K": (q4_k, QK_K, 144), "Q5_K": (q5_k, QK_K, 176), "Q6_K": (q6_k, QK_K, 210),
}
# the carrier's code width: 4-bit codes go as INT4, the 5- and 6-bit ones (and Q8_0) as INT8
CODE_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "Q6_K": 8}
# the types whose block scale d (and minimum m) is the file's own fp16 field: the bundle can store
# those as fp16 too. A K-quant's effective scale d·sc (and -dmin·mn) is a product of an fp16 and a
# 6- or 8-bit integer, 17-18 significant bits in general: float32 there
HALF_SCALES = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"})


def k_factors(kind: str, raw: np.ndarray, shape: tuple[int, int]):
    """A K-quant's scales (and minimums) as the file factors them: (d [N, K/256] float32 of fp16,
    sc [N, K/B] int8, dmin, mn) with scale = d·sc and min = -dmin·mn per sub-block (None for
    Q6_K's minimum; None for a type that is not a K-quant): what the bundle stores instead of the
    float32 products (export/weights.py: Factors)."""
    if kind not in ("Q4_K", "Q5_K", "Q6_K"):
        return None
    n = shape[0]
    return tuple(None if a is None else a.reshape(n, -1) for a in _k_fields(kind, _blocks(kind, raw, shape)))


def _blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The tensor's bytes as its blocks [N * K / per, bytes per block]."""
    _, per, nbytes = DECODERS[kind]
    n, k = shape
    if k % per:
        raise ValueError(f"{kind} matrix with {k} columns: not a multiple of its block {per}")
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(n * k // per, nbytes)


def decode(kind: str, raw: np.ndarray, shape: tuple[int, int]):
    """The codes, scales, block and mins of a matrix [N, K] stored as `kind`, or None when the type
    has no decoder here (IQ*, Q2_K, Q3_K, float types)."""
    if kind not in DECODERS:
        return None
    n, k = shape
    codes, scales, block, mins = DECODERS[kind][0](_blocks(kind, raw, shape))
    return (codes.reshape(n, k), scales.reshape(n, k // block), block,
            None if mins is None else mins.reshape(n, k // block))
