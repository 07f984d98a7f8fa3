"""cache-reads: the int8 cache's unit-scale DequantizeLinear reads as the Cast they compute.

The bundle writes every read of an int8 cache input as DequantizeLinear(x, 1.0[, 0]) because
TensorRT's parser takes INT8 only through Q/DQ (docs/graph.md); onnxruntime's DequantizeLinear
runs ~2x slower than its Cast, and at long contexts these reads of the whole past are most of a
decode step's attention (docs/benchmarks.md). x * 1.0 - 0 is the Cast's value exactly."""
from __future__ import annotations

from edgekv.graph.passes import Changed


def cast_reads(index) -> int:
    """Replace (in place) each unit-scale DequantizeLinear of an int8 graph input by a Cast to its
    scale's type; how many."""
    onnx = index.onnx
    consts = {n: t for n, t in index.inits.items() if t.data_location != onnx.TensorProto.EXTERNAL}

    def is_scalar(name: str, value: float) -> bool:  # a rank-0 constant equal to value
        t = consts.get(name)
        return t is not None and len(t.dims) == 0 and float(index.nh.to_array(t)) == value

    count = 0
    for node in index.g.node:
        if (node.op_type == "DequantizeLinear" and index.inputs.get(node.input[0]) == onnx.TensorProto.INT8
                and len(node.input) >= 2 and is_scalar(node.input[1], 1.0)
                and (len(node.input) < 3 or not node.input[2] or is_scalar(node.input[2], 0.0))
                and not any(a.name in ("block_size", "output_dtype") and a.i for a in node.attribute)):
            to = consts[node.input[1]].data_type  # DQ's output type is its scale's
            node.CopyFrom(onnx.helper.make_node("Cast", [node.input[0]], list(node.output), name=node.name, to=to))
            count += 1
    return count


class CacheReads:
    name = "cache-reads"

    def apply(self, index) -> Changed:
        n = cast_reads(index)
        return Changed(n > 0, n)
