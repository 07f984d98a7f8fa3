"""What TensorRT's parser rules (edgekv/format/trt_rules.py) see of an ONNX graph: its tensors'
element types, build-time constants and their shapes, who makes and who reads each tensor; the
graph read from a file without its weights; and the one staging step every graph TensorRT gets
goes through before the engine build's own rewrite (stage_weights): fp16 block scales Cast to
float32 folded into float32 initializers (widen_half_scales; onnxruntime folds the same Casts
itself at load), then the other weight forms (edgekv/format/weight_forms.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edgekv.format.weight_forms import fold_forms

# onnx TensorProto element types -> the table's names
TYPES = {1: "FP32", 2: "UINT8", 3: "INT8", 6: "INT32", 7: "INT64", 9: "BOOL", 10: "FP16", 11: "DOUBLE", 16: "BF16",
          17: "FP8", 21: "UINT4", 22: "INT4", 23: "FP4"}

@dataclass
class Violation:
    node: str
    op: str
    rule: str

    def __str__(self) -> str:
        return f"{self.node} ({self.op}): {self.rule}"


def block_size(node) -> int:
    """A Q/DQ node's block_size attribute (0: not block-wise)."""
    return next((a.i for a in node.attribute if a.name == "block_size"), 0)


@dataclass
class GraphFacts:
    """What the rules look up about a graph's tensors: element types, build-time constants
    (initializers and Constant outputs) with their shapes, the network's I/O, who makes and who
    reads each tensor."""
    types: dict[str, str] = field(default_factory=dict)
    constants: set[str] = field(default_factory=set)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    graph_inputs: set[str] = field(default_factory=set)
    graph_io: set[str] = field(default_factory=set)
    consumers: dict[str, list] = field(default_factory=dict)
    producers: dict[str, object] = field(default_factory=dict)


def graph_facts(g) -> GraphFacts:
    f = GraphFacts()
    for v in [*g.input, *g.value_info, *g.output]:
        f.types[v.name] = TYPES.get(v.type.tensor_type.elem_type, str(v.type.tensor_type.elem_type))
    for init in g.initializer:
        f.types[init.name] = TYPES.get(init.data_type, str(init.data_type))
        f.shapes[init.name] = list(init.dims)
        f.constants.add(init.name)
    for n in g.node:
        if n.op_type == "Constant":
            f.constants.update(n.output)
            for a in n.attribute:
                if a.name == "value":
                    f.types[n.output[0]] = TYPES.get(a.t.data_type, str(a.t.data_type))
                    f.shapes[n.output[0]] = list(a.t.dims)
    f.graph_inputs = {i.name for i in g.input}
    f.graph_io = f.graph_inputs | {o.name for o in g.output}
    for n in g.node:
        for i in n.input:
            f.consumers.setdefault(i, []).append(n)
        for o in n.output:
            f.producers[o] = n
    return f


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
    inits = {i.name: i for i in g.initializer}
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    outputs = {o.name for o in g.output}
    return [n for n in g.node if is_half_cast(n, inits) and readers[n.input[0]] == 1 and n.input[0] not in outputs]


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


def read_onnx(path: Path):
    """The graph at `path` (weights not loaded); an EdgeKVError for anything that is not one. An
    empty file parses as an empty ModelProto, which would otherwise pass every rule."""
    import onnx
    from google.protobuf.message import DecodeError

    from edgekv.errors import EdgeKVError

    if not path.is_file():
        raise EdgeKVError(f"{path}: no such ONNX file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, OSError, RuntimeError) as e:
        raise EdgeKVError(f"{path}: not an ONNX model ({type(e).__name__})") from None
    if not model.graph.node or not model.opset_import:
        raise EdgeKVError(f"{path}: not an ONNX model (no graph nodes or no opset)")
    return model
