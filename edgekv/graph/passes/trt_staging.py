"""trt-staging: what every graph TensorRT gets goes through before the engine build's own rewrite
(the engine build, check-trt's as-built check: edgekv/format/trt_rules.py): fp16 block scales
Cast to float32 folded into float32 initializers (widen_half_scales; onnxruntime folds the same
Casts itself at load), then the other weight forms (edgekv/graph/forms.py) folded into their tensors."""
from __future__ import annotations

from edgekv.graph.forms import form_values, replace_forms
from edgekv.graph.index import GraphIndex
from edgekv.graph.passes import Changed


def fold_forms(model, folder) -> list[str]:
    """Replace (in place) every form whose output a non-form node reads (or the graph returns) by an
    initializer of that name and value, and drop what only forms read: the graph a float32-scale,
    8-bit-code exporter wrote, name for name. Returns the folded names (none: untouched)."""
    from onnx import numpy_helper

    values, gone = form_values(model.graph, folder)
    if values:
        replace_forms(model.graph, gone, [numpy_helper.from_array(a, name) for name, a in values.items()])
    return list(values)


def is_half_cast(n, inits: dict) -> bool:
    """`n` is a Cast to float32 of an fp16 initializer (of `inits`, name -> TensorProto): how a
    bundle keeps a GGUF's fp16 block scales and minimums (export/weights_graph.py: X_f16 -> Cast -> X,
    where X was a float32 initializer), a constant for every reader of X."""
    from onnx import TensorProto

    return (n is not None and n.op_type == "Cast" and n.domain in ("", "ai.onnx") and len(n.input) == 1
            and n.input[0] in inits and inits[n.input[0]].data_type == TensorProto.FLOAT16
            and any(a.name == "to" and a.i == TensorProto.FLOAT for a in n.attribute))


def half_scale_casts(g) -> list:
    """The is_half_cast Casts whose fp16 initializer nothing else reads (TensorRT 10.3 takes a
    DequantizeLinear's scale only as a build-time constant: these are what the staging folds)."""
    ix = GraphIndex(g)
    readers = {name: len(nodes) for name, nodes in ix.consumers.items()}
    return [n for n in g.node if is_half_cast(n, ix.inits) and readers[n.input[0]] == 1 and n.input[0] not in ix.outputs]


def widen_half_scales(model, folder) -> list[str]:
    """Replace each of half_scale_casts' Casts in `model` (in place) by a float32 initializer of the
    Cast's output name and the same values (fp16 -> float32 is exact): the graph a float32-scale
    exporter wrote, name for name. The fp16 values are read from `folder` where they are external.
    Returns the widened tensors' names (none: the model is untouched)."""
    from onnx import numpy_helper

    g = model.graph
    casts = half_scale_casts(g)
    if not casts:
        return []
    inits = {i.name: i for i in g.initializer}
    drop = {c.input[0] for c in casts}
    wide = [numpy_helper.from_array(numpy_helper.to_array(inits[c.input[0]], str(folder)).astype("float32"), c.output[0])
            for c in casts]
    gone = {id(c) for c in casts}
    kept_nodes = [n for n in g.node if id(n) not in gone]
    del g.node[:]
    g.node.extend(kept_nodes)
    kept = [i for i in g.initializer if i.name not in drop]
    del g.initializer[:]
    g.initializer.extend(kept + wide)
    return [c.output[0] for c in casts]


def stage_weights(model, folder) -> list[str]:
    """What every graph TensorRT gets goes through first (the engine build, check-trt's as-built
    check), in place: fp16 block scales widened (widen_half_scales), then every other weight form,
    packed codes and factored scales, folded into its tensor (weight_forms.fold_forms). Returns the
    changed tensors' names (none: the model is untouched)."""
    return widen_half_scales(model, folder) + fold_forms(model, folder)


class TrtStaging:
    """The pass over an index (its base_dir: where external weights are read)."""
    name = "trt-staging"

    def apply(self, index) -> Changed:
        n = len(stage_weights(index.model, index.base_dir))
        return Changed(n > 0, n)
