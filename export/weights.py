"""Quantized weights: what each matrix is stored as, and the ONNX pass that stores it so.

The exporter runs the float model with weights that are *exactly* the dequantized values of
what the bundle stores (QuantWeight.dequantize), exports the float graph, and then
`quantize_initializers` replaces each such weight feeding a MatMul (or the embedding's Gather)
with its integer codes + DequantizeLinear. The graph therefore computes the same function as
the torch model by construction, and the parity check still catches layout and scale bugs.

Formats (docs/weights.md):
- INT4, signed, block-wise along K: DequantizeLinear(INT4 [K, N], scales [K/B, N], axis 0,
  block_size B, no zero point) -> MatMul. Opset 21. GGUF Q4_0 is this as it stands.
- GGUF Q4_1 and Q4_K (w = s*q + m per block of 32, q in 0..15; Q4_K: s = d*sc, m = -dmin*mn):
  codes shifted to signed (q - 8), W.x = DQ(q - 8, s).x + blocksum(x).(8s + m), the second term a
  MatMul 32x smaller computed as [8*blocksum(x), blocksum(x)] @ [s; m] so that s and m are each
  stored exactly (their sum is not always exact in float32).
- INT8 block-wise along K (blocks of 32, Q6_K's of 16): the same DequantizeLinear with INT8 codes:
  GGUF Q8_0 as it stands, Q5_0 (q - 16), Q6_K (q - 32), Q5_1 and Q5_K (q in 0..31 with the
  blocksum(x).m term). onnxruntime runs it as fast as per channel (its fused kernel is block-wise
  either way); TensorRT takes block-wise DQ only for INT4, so the engine build requantizes these
  per output channel (edgekv/runtime/backends/engines.py: tensorrt_graph).
- The embedding: Gather on the INT8 table, DequantizeLinear with a unit scale, then the gathered
  rows times their (block) scales (plus their minimums); no float copy of the table exists.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from edgekv.format.weight_forms import code_width, packable
from export.gguf_blocks import CODE_BITS, HALF_SCALES, decode, k_factors
GROUPS = (32, 64, 128)
METHODS = ("awq", "clip", "rtn")  # requantizing float to INT4: AWQ scales + clip search, clip search, round-to-nearest
CLIP_RATIOS = tuple(np.round(np.arange(1.0, 0.49, -0.05), 2))  # searched per group, best error kept


@dataclass
class Factors:
    """A K-quant's per-block scales (or minimums) as its file stores them: values = d·sc, with d
    [N, K/256] float32 holding fp16 values (one per super-block) and sc [N, K/B] small integers
    (int8). The product is exact in float32 (at most 11 + 8 significant bits)."""
    d: np.ndarray
    sc: np.ndarray

    def rows(self, fn) -> "Factors":
        return Factors(fn(self.d), fn(self.sc))

    @property
    def nbytes(self) -> int:
        return 2 * self.d.size + self.sc.size


@dataclass
class QuantWeight:
    """One matrix W [N, K] (torch Linear layout: N outputs, K inputs) as the bundle stores it."""
    bits: int                        # 4 or 8
    codes: np.ndarray                # int8 [N, K]; -8..7 for 4 bits, -127..127 for 8
    scales: np.ndarray               # float32 [N, K/block] (block-wise) or [N] (per output channel)
    block: int | None                # block size along K; None = per output channel
    origin: str                      # where the codes come from (manifest)
    mins: np.ndarray | None = None   # float32 [N, K/block]: a GGUF type's minimum, W = (codes + shift)*scales + mins
    shift: int = 0                   # 4-bit codes of an unsigned type stored as q - shift (signed INT4)
    source: str = ""                 # the GGUF block type(s) the codes are ("Q4_K", "Q5_0|Q5_0|Q8_0"); "" = requantized
    scale_factors: Factors | None = None  # a K-quant's scales as the file factors them (stored so)
    min_factors: Factors | None = None    # ... and its minimums (-dmin·mn: d = -dmin, sc = mn)

    def dequantize(self) -> np.ndarray:
        """The float values the graph computes with, in float64 rounded once to float32 (each
        term is exact in float64, so this is the file's own float32 value: tests/test_gguf_kquants.py)."""
        c = self.codes.astype(np.float64) + self.shift
        if self.block is None:
            return (c * self.scales.astype(np.float64)[:, None]).astype(np.float32)
        n, k = c.shape
        w = c.reshape(n, k // self.block, self.block) * self.scales.astype(np.float64)[..., None]
        if self.mins is not None:
            w = w + self.mins.astype(np.float64)[..., None]
        return w.reshape(n, k).astype(np.float32)

    @property
    def carrier(self) -> str:
        """How the graph carries it, in words (the manifest's per-matrix record)."""
        if self.block is None:
            return f"INT{self.bits} per output channel"
        return (f"INT{self.bits} blocks of {self.block}" + (f", codes q - {self.shift}" if self.shift else "")
                + (" + blocksum(x)·min" if self.mins is not None else "")
                + (", fp16 scales" + (" and minimums" if self.mins is not None else "") + " (the file's)"
                   if self.half_scales else "")
                + (f", stored as {self.width[0]}-bit codes" if self.width[0] < self.bits else "")
                + (", scales" + (" and minimums" if self.min_factors else "") + " as the file's fp16 d times integer sc"
                   if self.scale_factors else ""))

    @cached_property
    def half_scales(self) -> bool:
        """Whether the bundle stores the scales (and minimums) as fp16, Cast to float32 in the graph:
        where every part's type keeps them as fp16 in the file (HALF_SCALES; a fused matrix with a
        K-quant part is float32), checked exact rather than trusted (a Q4_0 part's -8·d minimum
        beside Q4_1 is an fp16 too, unless it overflows)."""
        if not self.source or self.block is None or not set(self.source.split("|")) <= HALF_SCALES:
            return False
        return all(exact_in_half(a) for a in (self.scales, self.mins) if a is not None)

    @cached_property
    def width(self) -> tuple[int, int]:
        """(bits, offset) the 8-bit codes are stored at: a GGUF's 5- and 6-bit codes (Q5_*, Q6_K) at
        their own width, unpacked by the graph (edgekv/format/weight_forms.py); (bits, 0) otherwise."""
        if self.bits != 8:
            return self.bits, 0
        bits, offset = code_width(self.codes)
        return (bits, offset) if packable(self.codes.T.shape, bits) and packable(self.codes.shape, bits) else (8, 0)

    @property
    def nbytes(self) -> int:
        """Bytes in the bundle: packed codes + the scales (+ the minimums), fp16 where half_scales."""
        codes = self.codes.size * self.width[0] // 8
        side = 2 if self.half_scales else 4

        def cost(values, factors):
            return 0 if values is None else factors.nbytes if factors is not None else side * values.size
        return codes + cost(self.scales, self.scale_factors) + cost(self.mins, self.min_factors)


def exact_in_half(a: np.ndarray) -> bool:
    """Every value of the float32 array `a` is an fp16 (finite), so storing it as one loses nothing."""
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    return bool(np.isfinite(h).all() and np.array_equal(h.astype(np.float32), a))


def to_eight_bit(q: QuantWeight) -> QuantWeight:
    """The same values as 8-bit codes (unshifted: an INT8 carrier holds 0..15 as it is)."""
    if q.bits == 8:
        return q
    return QuantWeight(8, (q.codes.astype(np.int16) + q.shift).astype(np.int8), q.scales, q.block, q.origin, q.mins,
                       0, q.source, q.scale_factors, q.min_factors)


def _reblock(q: QuantWeight, block: int, shift: int, with_mins: bool) -> QuantWeight:
    """The same values with scales (and mins) repeated down to `block`, the codes shifted by
    `shift` and a zero minimum where there was none: every step exact."""
    r = q.block // block
    scales = np.repeat(q.scales, r, axis=1)
    mins = np.repeat(q.mins, r, axis=1) if q.mins is not None else (np.zeros_like(scales) if with_mins else None)
    if shift != q.shift:  # Q4_0's signed codes beside Q4_1's shifted ones: (c + 8)*s - 8s = c*s
        mins = mins - np.float32(shift - q.shift) * scales  # a power of two times s: exact
    # the factors hold only where the values are the file's: the scales at their block, the minimums unshifted too
    return QuantWeight(q.bits, q.codes, scales, block, q.origin, mins, shift, q.source,
                       q.scale_factors if r == 1 else None,
                       q.min_factors if r == 1 and shift == q.shift and q.mins is not None else None)


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Fused matrices (q|k|v, gate|up) stack output rows; blocks along K are unaffected. Parts in
    different carriers (Q4_K_M mixes Q5_0, Q8_0, Q6_K) meet in one that holds each exactly: 8-bit
    codes if any part has them, the smallest block, a minimum if any part has one."""
    if any(p.block is None for p in parts):
        raise ValueError("cannot fuse matrices stored per output channel")
    bits = max(p.bits for p in parts)
    parts = [to_eight_bit(p) if bits == 8 else p for p in parts]
    block = min(p.block for p in parts)
    if any(p.block % block for p in parts):
        raise ValueError("cannot fuse matrices whose blocks do not nest")
    shift = max(p.shift for p in parts)
    with_mins = any(p.mins is not None for p in parts)
    parts = [_reblock(p, block, shift, with_mins) for p in parts]
    a = parts[0]
    sources = [p.source for p in parts]
    source = sources[0] if len(set(sources)) == 1 else "|".join(sources)
    origin = a.origin if len({p.origin for p in parts}) == 1 else f"gguf {source}"
    return QuantWeight(bits, np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                       block, origin, np.concatenate([p.mins for p in parts]) if with_mins else None, shift, source,
                       _concat_factors([p.scale_factors for p in parts]), _concat_factors([p.min_factors for p in parts]))


def _concat_factors(fs: list) -> Factors | None:
    """Stacked rows of every part's factors, where each part has them at the same shape per row."""
    if any(f is None for f in fs) or len({(f.d.shape[1], f.sc.shape[1]) for f in fs}) != 1:
        return None
    return Factors(np.concatenate([f.d for f in fs]), np.concatenate([f.sc for f in fs]))


def permute_rows(q: QuantWeight, fn) -> QuantWeight:
    """Apply a row permutation (llama.cpp's q/k interleave undone) to codes, scales and mins."""
    return QuantWeight(q.bits, fn(q.codes), fn(q.scales), q.block, q.origin, None if q.mins is None else fn(q.mins),
                       q.shift, q.source, q.scale_factors and q.scale_factors.rows(fn),
                       q.min_factors and q.min_factors.rows(fn))


# --- GGUF blocks, read as they are ---------------------------------------------------------

KEPT_BITS = CODE_BITS  # the GGUF block types from_gguf_blocks keeps exactly -> their carrier's code bits


def auto_format(types: dict[str, set[str]], embed: str, head: str) -> str:
    """`--weights auto`: the stored format that keeps what the source holds. types: each 2-D weight
    (fused matrices under one name) -> the source's block types of its parts (none: float). Every
    projection in kept block types, some of them 4-bit codes (Q4_0, Q4_1, Q4_K) -> int4 (the wider
    ones, Q5_*, Q6_K, Q8_0, stay 8-bit codes under int4); all wider -> int8; anything else (a
    float matrix, or a type not kept such as Q3_K or IQ4_XS) -> float, the source's exact values.
    A fused matrix whose parts mix types is carried at the widest (concat_rows). The embedding and
    head do not decide: they are 8-bit codes under int4 and int8 either way."""
    parts = {name: {p for t in ts for p in t.split("|")} for name, ts in types.items()}  # "Q5_0|Q8_0": a fused record
    bits = [max(KEPT_BITS.get(t, 0) for t in ts) if ts and all(t in KEPT_BITS for t in ts) else None
            for name, ts in parts.items() if name not in (embed, head)]
    if not bits or None in bits:
        return "float"
    return "int4" if 4 in bits else "int8"


def from_gguf_blocks(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantWeight | None:
    """raw: the tensor's bytes [N, bytes per row]; shape (N, K). None for a block type not kept
    (float types are float already; IQ*, Q2_K, Q3_K have no carrier here). The blocks as codes and
    exact float32 scales (export/gguf_blocks.py); Q4_1/Q4_K's unsigned 4-bit codes shifted to
    signed INT4 (shift 8, the 8s folded back by the graph's blocksum term)."""
    got = decode(kind, raw, shape)
    if got is None:
        return None
    codes, scales, block, mins = got
    bits, shift = KEPT_BITS[kind], 0
    if bits == 4 and mins is not None:
        codes, shift = codes - 8, 8
    f = k_factors(kind, raw, shape)  # (d, sc, dmin, mn): a K-quant's scales as the file stores them
    scale_factors = Factors(f[0], f[1]) if f else None
    min_factors = Factors(-f[2], f[3]) if f and f[2] is not None else None  # min = -dmin·mn
    return QuantWeight(bits, codes, scales, block, f"gguf {kind}", mins, shift, kind, scale_factors, min_factors)


# --- from float ------------------------------------------------------------------------------

def int8_per_channel(w: np.ndarray, origin: str = "int8 per output channel, absmax") -> QuantWeight:
    w = w.astype(np.float32)
    s = np.maximum(np.abs(w).max(1), 1e-12) / 127.0
    q = np.clip(np.rint(w / s[:, None]), -127, 127).astype(np.int8)
    return QuantWeight(8, q, s.astype(np.float32), None, origin)


def int8_blocks(w: np.ndarray, block: int = 32, origin: str = "int8 per block of 32, absmax") -> QuantWeight:
    """Symmetric INT8 per block of `block` inputs (Q8_0's layout, float32 scales)."""
    n, k = w.shape
    wb = w.astype(np.float32).reshape(n, k // block, block)
    s = np.maximum(np.abs(wb).max(-1), 1e-12) / 127.0
    q = np.clip(np.rint(wb / s[..., None]), -127, 127).astype(np.int8).reshape(n, k)
    return QuantWeight(8, q, s.astype(np.float32), block, origin)


def int4_groups(w: np.ndarray, group: int, search: bool = True, gram: np.ndarray | None = None) -> QuantWeight:
    """Symmetric INT4 per group of `group` inputs. search: for each group the clip ratio (of the
    absmax) whose codes reconstruct the group with the least error; else round-to-nearest. The
    error is squared weight error, or with `gram` [K/group, group, group] (the group's inputs'
    x^T x on calibration rows) the squared error of the group's share of the output."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"--group {group} does not divide a matrix's input size {k}")
    wg = w.astype(np.float32).reshape(n, k // group, group)
    amax = np.maximum(np.abs(wg).max(-1), 1e-12)
    best_s, best_err = None, None
    for r in (CLIP_RATIOS if search else (1.0,)):
        s = (r * amax / 7.0).astype(np.float32)
        d = np.clip(np.rint(wg / s[..., None]), -8, 7) * s[..., None] - wg  # [N, G, B]
        if gram is None:
            err = (d ** 2).sum(-1)
        else:  # d^T G d per (row, group): batched over groups
            dg = d.transpose(1, 0, 2)  # [G, N, B]
            err = (np.matmul(dg, gram) * dg).sum(-1).T  # [N, G]
        if best_s is None:
            best_s, best_err = s, err
        else:
            better = err < best_err
            best_s, best_err = np.where(better, s, best_s), np.where(better, err, best_err)
    q = np.clip(np.rint(wg / best_s[..., None]), -8, 7).astype(np.int8).reshape(n, k)
    how = ("activation-weighted clip search" if gram is not None else "clip-ratio search") if search else "round-to-nearest"
    return QuantWeight(4, q, best_s, group, f"int4 symmetric per {group}, {how}")


# --- the plan: what each weight becomes ------------------------------------------------------

def plan_weights(state: dict, kept: dict[str, QuantWeight], fmt: str, group: int, embed: str, head: str,
                 search: bool = True) -> dict[str, QuantWeight]:
    """state: name -> float [N, K] (numpy). kept: the source's own blocks by name (GGUF).
    Every 2-D projection gets fmt. Under int4 a source's 4-bit blocks stay INT4 and its wider
    ones (Q5_*, Q6_K, Q8_0) stay exact 8-bit codes (never narrowed to 4 bits); under int8 every
    kept block type is carried exactly as 8-bit codes. A matrix without kept blocks is
    requantized: INT4 groups (int4) or INT8 blocks of 32 (int8, the head). The embedding and the
    head keep the source's blocks as 8-bit codes, else INT8 per row / blocks of 32."""
    if fmt == "float":
        return {}
    plan = {}

    def eight_bit(name):
        src = kept.get(name)
        if src is not None and src.block is not None:
            return to_eight_bit(src)  # the source's own blocks, exactly
        if state[name].shape[1] % 32:  # blocks need K in multiples of 32
            return int8_per_channel(state[name])
        return int8_blocks(state[name], 32, "int8 per block of 32" + (f", from {src.origin}" if src else ""))

    for name, w in state.items():
        if w.ndim != 2 or name in (embed, head):
            continue
        src = kept.get(name)
        if fmt == "int4" and src is not None and src.bits == 4:
            plan[name] = src  # the source's own 4-bit blocks, exactly
        elif fmt == "int4" and src is None:
            plan[name] = int4_groups(w, group, search)
        else:  # int8, or a source matrix with wider codes under int4
            plan[name] = eight_bit(name)
    src = kept.get(embed)
    plan[embed] = to_eight_bit(src) if src is not None and src.block is not None else int8_per_channel(state[embed], "int8 per row")
    # a tied head is the table's own blocks: the same object, stored once (quantize_initializers)
    tied = kept.get(head) is not None and kept.get(head) is kept.get(embed) and plan[embed].bits == 8
    plan[head] = plan[embed] if tied else eight_bit(head)
    return plan


def stored_bytes(plan: dict[str, QuantWeight]) -> int:
    """Bytes of the quantized matrices as stored: a tied head sharing the table counts once."""
    return sum(q.nbytes for q in {id(q): q for q in plan.values()}.values())


def summary(plan: dict[str, QuantWeight]) -> dict:
    """The manifest's record of the weights: formats by count and bytes."""
    by, seen = {}, set()
    for q in plan.values():
        r = by.setdefault(q.origin, {"tensors": 0, "bytes": 0})
        r["tensors"] += 1
        r["bytes"] += 0 if id(q) in seen else q.nbytes  # a tied head and its table: one copy
        seen.add(id(q))
    return by
