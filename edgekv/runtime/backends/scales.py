"""A bundle's fp16 block scales widened to float32 initializers at load, in memory (the bundle is
untouched; docs/weights.md, "fp16 scales").

A GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks hold their scale d (and minimum m) as fp16; the
exporter stores them so, behind a Cast to float32 (export/weights.py `_side`: X_f16 -> Cast -> X,
where an older bundle had the float32 initializer X). A DequantizeLinear of an fp16 scale would
output fp16 and round d*q; the Cast keeps every product exact, and onnxruntime folds it at load on
its own. The rewrites that read scale and minimum initializers by name before the session is made
(nbits.py's minimum fold, fused.py) find them as initializers after this pass: each Cast of an fp16
initializer to float32 becomes a float32 initializer of the Cast's output name, the graph an
older exporter wrote, name for name. A graph without such Casts (every float32-scale bundle) is
returned as it came, the same bytes.

The pass itself is the format layer's (edgekv/format/trt_graph.py: widen_half_scales), the one the
TensorRT staging applies too."""
from __future__ import annotations

from edgekv.format.trt_graph import half_scale_casts, widen_half_scales


def float32_scales(model, base_dir: str) -> list[str]:
    """`model` (an onnx ModelProto, weights external under `base_dir`) with every fp16 scale's Cast
    replaced by its float32 initializer, in place. Returns the widened tensors' names."""
    return widen_half_scales(model, base_dir)


def float32_scales_graph(graph: bytes, base_dir: str) -> bytes:
    """The serialized graph with its fp16 scales widened (as given when it has none)."""
    import onnx

    model = onnx.load_from_string(graph)
    if not half_scale_casts(model.graph):
        return graph
    float32_scales(model, base_dir)
    return model.SerializeToString()
