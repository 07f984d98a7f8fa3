"""Weights a bundle stores smaller than the tensor a node reads, written by the exporter: a constant
subgraph ("form") of a few integer and Cast ops over initializers, which onnxruntime folds into one
tensor at load and the TensorRT staging folds the same way (what reads them in a graph:
edgekv/graph/forms.py; the passes: edgekv/graph/passes/). Three forms (docs/weights.md, "Codes at the
file's width"):

- an fp16 block scale or minimum: X_f16 -> Cast(float32) -> X (a GGUF's own fp16 fields);
- 5- or 6-bit codes (GGUF Q5_*, Q6_K): the low nibbles two per byte and the high bits packed
  8/h per byte along axis 0, unpacked by BitShift / BitwiseAnd / BitwiseOr, Cast to INT8 and
  offset (pack_codes);
- a K-quant's block scale d·sc: the super-block's fp16 d times the sub-block's small integer sc
  (export/weights_graph.py: _factored), a float32 product that is exact.

The exporter writes each form's output name, type and shape as value_info, so what reads a
weight's element type and dims (the runtime's rewrites) need not evaluate it."""
from __future__ import annotations

import numpy as np


def code_width(codes: np.ndarray) -> tuple[int, int]:
    """(bits, offset): the fewest bits of 5, 6 that hold every code as an unsigned q = code + offset
    (offset 0, or 2^(bits-1) for signed codes), else (8, 0): stored as INT8 as it is."""
    lo, hi = int(codes.min(initial=0)), int(codes.max(initial=0))
    for bits in (5, 6):
        for offset in (0, 1 << (bits - 1)):
            if lo + offset >= 0 and hi + offset < (1 << bits):
                return bits, offset
    return 8, 0


def packable(shape: tuple, bits: int) -> bool:
    return bits < 8 and len(shape) >= 2 and shape[0] % (8 // (bits - 4)) == 0 and shape[0] % 2 == 0


def pack_codes(name: str, codes: np.ndarray, bits: int, offset: int) -> tuple[list, list, object]:
    """INT8 `codes` (any shape, axis 0 a multiple of 8 / (bits - 4)) as a form named `name`:
    (initializers, nodes, the value_info of `name`). q = codes + offset in 0..2^bits - 1; its low
    nibbles go two per byte along axis 0 (element 2i in the low nibble of byte i), its high
    h = bits - 4 bits 8/h per byte along axis 0 (element (8/h)i + j at bit h·j of byte i)."""
    from onnx import TensorProto, helper, numpy_helper

    h = bits - 4
    shape = codes.shape
    q = (codes.astype(np.int16) + offset).astype(np.uint8).reshape(shape[0], -1)  # [A, R]
    a, r = q.shape
    low, high = q & 0x0F, q >> 4
    lo = low[0::2] | (low[1::2] << 4)  # [A/2, R]
    per = 8 // h
    hi = np.zeros((a // per, r), np.uint8)
    for j in range(per):
        hi |= (high[j::per] << (h * j)).astype(np.uint8)
    inits = [numpy_helper.from_array(lo, name + "_lo"), numpy_helper.from_array(hi, name + "_hi"),
             numpy_helper.from_array(np.array([0, 4], np.uint8).reshape(1, 2, 1), name + "_nib"),
             numpy_helper.from_array((np.arange(per) * h).astype(np.uint8).reshape(1, per, 1), name + "_bit"),
             numpy_helper.from_array(np.array(15, np.uint8), name + "_m4"),
             numpy_helper.from_array(np.array((1 << h) - 1, np.uint8), name + "_mh"),
             numpy_helper.from_array(np.array(4, np.uint8), name + "_four"),
             numpy_helper.from_array(np.array([1], np.int64), name + "_ax1"),
             numpy_helper.from_array(np.array(shape, np.int64), name + "_shape")]
    mk = helper.make_node
    nodes = [mk("Unsqueeze", [name + "_lo", name + "_ax1"], [name + "_lo3"], name=name + "_lo3"),
             mk("BitShift", [name + "_lo3", name + "_nib"], [name + "_los"], direction="RIGHT", name=name + "_los"),
             mk("BitwiseAnd", [name + "_los", name + "_m4"], [name + "_lom"], name=name + "_lom"),
             mk("Reshape", [name + "_lom", name + "_shape"], [name + "_low"], name=name + "_low"),
             mk("Unsqueeze", [name + "_hi", name + "_ax1"], [name + "_hi3"], name=name + "_hi3"),
             mk("BitShift", [name + "_hi3", name + "_bit"], [name + "_his"], direction="RIGHT", name=name + "_his"),
             mk("BitwiseAnd", [name + "_his", name + "_mh"], [name + "_him"], name=name + "_him"),
             mk("Reshape", [name + "_him", name + "_shape"], [name + "_hir"], name=name + "_hir"),
             mk("BitShift", [name + "_hir", name + "_four"], [name + "_high"], direction="LEFT", name=name + "_high"),
             mk("BitwiseOr", [name + "_low", name + "_high"], [name + "_u8"], name=name + "_u8")]
    if offset:
        inits.append(numpy_helper.from_array(np.array(offset, np.int8), name + "_offset"))
        nodes += [mk("Cast", [name + "_u8"], [name + "_i8"], to=TensorProto.INT8, name=name + "_i8"),
                  mk("Sub", [name + "_i8", name + "_offset"], [name], name=name + "_unpack")]
    else:
        nodes.append(mk("Cast", [name + "_u8"], [name], to=TensorProto.INT8, name=name + "_unpack"))
    return inits, nodes, helper.make_tensor_value_info(name, TensorProto.INT8, list(shape))
