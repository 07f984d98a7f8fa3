"""GraphIndex: one ONNX graph with the look-ups every pass needs (docs/graph.md, "Graph passes").

Who makes and who reads each value, the initializers and value_info by name, the graph's inputs
and outputs, constants' values (an initializer, read from the bundle's folder where external; a
Constant node; a weight form, edgekv/graph/forms.py), and the edits a rewrite makes (rename a
value, replace the node list, topological order, prune what no output needs). A pass that edits
the protobuf directly calls `reindex()` before it reads the maps again."""
from __future__ import annotations

import numpy as np

# the ops of a weight form: a constant subgraph over initializers that stores a weight smaller than
# the tensor a node reads (edgekv/graph/forms.py; the exporter writes them: format/weight_forms.py)
FORM_OPS = frozenset({"Cast", "Unsqueeze", "Reshape", "BitShift", "BitwiseAnd", "BitwiseOr", "Sub", "Mul"})


def cone(name: str, producers: dict, inits) -> list | None:
    """The nodes, in order, computing `name` from initializers alone through FORM_OPS ([] for an
    initializer itself), else None."""
    if name in inits:
        return []
    n = producers.get(name)
    if n is None or n.op_type not in FORM_OPS or n.domain not in ("", "ai.onnx"):
        return None
    out: list = []
    for i in n.input:
        c = cone(i, producers, inits)
        if c is None:
            return None
        out += [x for x in c if all(x is not y for y in out)]
    return out + [n]


def evaluate(name: str, nodes: list, inits: dict, folder) -> np.ndarray:
    """The value of `name`, computed by onnx's reference evaluator over `nodes` (a cone) with the
    initializers they read (inits: name -> TensorProto, external ones read from `folder`)."""
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    if not nodes:
        return numpy_helper.to_array(inits[name], str(folder))
    used = {i for n in nodes for i in n.input if i in inits}
    g = helper.make_graph(list(nodes), "form", [], [helper.make_tensor_value_info(name, 0, None)],
                          [numpy_helper.from_array(numpy_helper.to_array(inits[i], str(folder)), i) for i in sorted(used)])
    return ReferenceEvaluator(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])).run(None, {})[0]


class GraphIndex:
    """`model`: an onnx ModelProto (or a bare GraphProto: model is then None); `base_dir`: where
    its external initializers are."""

    def __init__(self, model, base_dir: str = "."):
        import onnx
        from onnx import numpy_helper

        self.onnx, self.nh = onnx, numpy_helper
        self.model = model if hasattr(model, "graph") else None
        self.g = model.graph if self.model is not None else model
        self.base_dir = str(base_dir)
        self.memo: dict = {}  # what a pass computed once about this graph (the fused pass's RoPE tables)
        # values a session takes by reference (name -> array) for placeholder initializers
        # (edgekv/graph/forms.py: handed_tensor): what the weight passes derive at load
        self.handed: dict = {}
        self.reindex()

    @classmethod
    def from_bytes(cls, data: bytes, base_dir: str = ".") -> "GraphIndex":
        import onnx
        return cls(onnx.load_from_string(data), base_dir)

    @classmethod
    def from_path(cls, path) -> "GraphIndex":
        """The graph at `path`, its weights left in their file (read on demand by `const`)."""
        import onnx
        from pathlib import Path
        return cls(onnx.load(str(path), load_external_data=False), str(Path(path).parent))

    def serialize(self) -> bytes:
        return self.model.SerializeToString()

    def reindex(self) -> None:
        """Rebuild every map from the protobuf (after an edit made around the helpers)."""
        g = self.g
        self.producer = {o: n for n in g.node for o in n.output if o}
        self.consumers: dict[str, list] = {}
        for n in g.node:
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
        self.inits = {t.name: t for t in g.initializer}
        self.infos = {v.name: v for v in g.value_info}
        self.inputs = {i.name: i.type.tensor_type.elem_type for i in g.input}
        self.outputs = {o.name for o in g.output}

    # -- reading
    def is_external(self, name: str) -> bool:
        t = self.inits.get(name)
        return t is not None and t.data_location == self.onnx.TensorProto.EXTERNAL

    def const(self, name: str, external: bool = True, forms: bool = True) -> np.ndarray | None:
        """The value of a constant: an initializer (an external one read from base_dir unless
        `external` is False), a Constant node's value, or (`forms`) a weight form evaluated."""
        t = self.inits.get(name)
        if t is not None:
            if self.is_external(name):
                return self.nh.to_array(t, self.base_dir) if external else None
            return self.nh.to_array(t)
        n = self.producer.get(name)
        if n is not None and n.op_type == "Constant":
            if not n.attribute:
                return None
            v = self.onnx.helper.get_attribute_value(n.attribute[0])
            if n.attribute[0].name == "value":
                return self.nh.to_array(v)
            return None if forms else np.asarray(v)  # value_float and the like (forms=False: any)
        if not forms:
            return None
        nodes = cone(name, self.producer, self.inits)
        return evaluate(name, nodes, self.inits, self.base_dir) if nodes else None

    def scalar(self, name: str, **kw) -> float | None:
        v = self.const(name, **kw)
        return float(v) if v is not None and v.ndim == 0 else None

    def ints(self, name: str, **kw) -> list | None:
        v = self.const(name, **kw)
        return v.tolist() if v is not None and v.ndim == 1 else None

    def is_const(self, name: str) -> bool:
        """An initializer, or a weight form over initializers (a constant onnxruntime folds at load)."""
        return cone(name, self.producer, self.inits) is not None

    def tensor(self, name: str) -> tuple[int, list[int]] | None:
        """(element type, dims) of an initializer or a weight form (its value_info), else None."""
        t = self.inits.get(name)
        if t is not None:
            return t.data_type, list(t.dims)
        v = self.infos.get(name)
        if v is not None and self.is_const(name):
            return v.type.tensor_type.elem_type, [d.dim_value for d in v.type.tensor_type.shape.dim]
        return None

    def const_dims(self, name: str) -> list[int] | None:
        """Dims of a weight: an initializer, or the DequantizeLinear of one (quantized weights)."""
        t = self.inits.get(name)
        if t is not None:
            return list(t.dims)
        n = self.producer.get(name)
        if n is not None and n.op_type == "Constant":
            return list(n.attribute[0].t.dims)
        codes = self.tensor(n.input[0]) if n is not None and n.op_type == "DequantizeLinear" else None
        return codes[1] if codes else None

    def op(self, name: str, *ops: str):
        """The node producing `name` if it is one of `ops`, else None."""
        n = self.producer.get(name)
        return n if n is not None and n.op_type in ops else None

    def attr(self, node, name: str, default=None):
        for a in node.attribute:
            if a.name == name:
                return self.onnx.helper.get_attribute_value(a)
        return default

    def only_reader(self, name: str, node) -> bool:
        """`node` is the one node reading `name`, and no graph output is `name`."""
        readers = self.consumers.get(name, [])
        return len(readers) == 1 and readers[0] is node and name not in self.outputs

    # -- writing
    def add_initializer(self, tensor) -> str:
        self.g.initializer.append(tensor)
        self.inits[tensor.name] = self.g.initializer[-1]
        return tensor.name

    def rename(self, old: str, new: str, reindex: bool = True) -> None:
        """Every node input and output `old` becomes `new` (the maps rebuilt unless `reindex` is False:
        a caller renaming many values rebuilds them once)."""
        for n in self.g.node:
            for k, x in enumerate(n.input):
                if x == old:
                    n.input[k] = new
            for k, x in enumerate(n.output):
                if x == old:
                    n.output[k] = new
        if reindex:
            self.reindex()

    def set_nodes(self, nodes: list) -> None:
        """The graph's node list replaced by `nodes` (in that order; the maps are rebuilt)."""
        del self.g.node[:]
        self.g.node.extend(nodes)
        self.reindex()

    def toposort(self, refuse) -> None:
        """Order the nodes so every input is produced before it is read (new nodes were appended);
        `refuse(message)`: the exception raised for a cycle or an input nobody produces."""
        have = {i.name for i in self.g.input} | {t.name for t in self.g.initializer} | {""}
        out, pending = [], list(self.g.node)
        while pending:
            rest = []
            for n in pending:
                if all(x in have for x in n.input):
                    out.append(n)
                    have.update(n.output)
                else:
                    rest.append(n)
            if len(rest) == len(pending):
                raise refuse("the rewritten graph has a cycle or an input nobody produces: "
                             + ", ".join(x for n in rest[:3] for x in n.input if x not in have))
            pending = rest
        self.set_nodes(out)

    def prune(self) -> set[str]:
        """Drop the nodes and initializers (of a topologically sorted graph) that no graph output
        needs; the names still needed (the maps are rebuilt)."""
        need = prune_unneeded(self.g)
        self.reindex()
        return need


def prune_unneeded(graph) -> set[str]:
    """Drop the nodes and initializers of a topologically sorted GraphProto that no graph output
    needs; the names still needed."""
    need = {o.name for o in graph.output}
    keep = []
    for n in reversed(list(graph.node)):
        if any(o in need for o in n.output):
            keep.append(n)
            need.update(x for x in n.input if x)
    del graph.node[:]
    graph.node.extend(reversed(keep))
    inits = [t for t in graph.initializer if t.name in need]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    return need
