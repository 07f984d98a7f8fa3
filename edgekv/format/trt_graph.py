"""What TensorRT's parser rules (edgekv/format/trt_rules.py) see of an ONNX graph: its tensors'
element types, build-time constants and their shapes, who makes and who reads each tensor; the
graph read from a file without its weights. The one staging step every graph TensorRT gets goes
through before the engine build's own rewrite is the trt-staging pass (stage_weights,
edgekv/graph/passes/trt_staging.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgekv.graph.index import GraphIndex

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


class GraphFacts:
    """What the rules look up about a graph's tensors: element types (TYPES' names), build-time
    constants (initializers and Constant outputs) with their shapes, the network's I/O, and who
    makes and who reads each tensor (the graph index's own maps: edgekv/graph/index.py)."""

    def __init__(self, index: GraphIndex):
        g = index.g
        self.types: dict[str, str] = {}
        self.shapes: dict[str, list[int]] = {}
        self.constants: set[str] = set()
        for v in [*g.input, *g.value_info, *g.output]:
            self.types[v.name] = TYPES.get(v.type.tensor_type.elem_type, str(v.type.tensor_type.elem_type))
        for init in g.initializer:
            self.types[init.name] = TYPES.get(init.data_type, str(init.data_type))
            self.shapes[init.name] = list(init.dims)
            self.constants.add(init.name)
        for n in g.node:
            if n.op_type == "Constant":
                self.constants.update(n.output)
                for a in n.attribute:
                    if a.name == "value":
                        self.types[n.output[0]] = TYPES.get(a.t.data_type, str(a.t.data_type))
                        self.shapes[n.output[0]] = list(a.t.dims)
        self.graph_inputs = set(index.inputs)
        self.graph_io = self.graph_inputs | index.outputs
        self.consumers, self.producers = index.consumers, index.producer


def graph_facts(g) -> GraphFacts:
    return GraphFacts(GraphIndex(g))


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
