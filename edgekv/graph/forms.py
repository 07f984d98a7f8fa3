"""Weight forms: weights a bundle stores smaller than the tensor a node reads, a constant subgraph
("form") of a few integer and Cast ops over initializers (docs/weights.md, "Codes at the file's
width"; the exporter writes them: edgekv/format/weight_forms.py). A form's nodes and value are
the index's (index.py: cone, evaluate); found here for the passes that fold or unpack them (and
handed placeholders for the values); onnxruntime would fold them into one tensor at load, and the
TensorRT staging does (passes/trt_staging.py).

The exporter writes each form's output name, type and shape as value_info, so what reads a
weight's element type and dims (the runtime's rewrites) need not evaluate it."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgekv.graph.index import FORM_OPS, GraphIndex, cone, evaluate


def forms(g, least: int = 1) -> dict[str, list]:
    """Every form of at least `least` nodes whose output a non-form node reads (or the graph
    returns): its output's name -> its nodes (the objects: protobuf's wrappers keep their id only
    while referenced)."""
    return _forms(GraphIndex(g), least)


def _forms(ix: GraphIndex, least: int) -> dict[str, list]:
    g, inits, producers = ix.g, ix.inits, ix.producer
    readers = [i for n in g.node if n.op_type not in FORM_OPS for i in n.input] + [o.name for o in g.output]
    found = {}
    for name in dict.fromkeys(readers):
        nodes = cone(name, producers, inits)
        if nodes and len(nodes) >= least:
            found[name] = nodes
    return found


def form_values(g, folder, least: int = 1) -> tuple[dict[str, np.ndarray], list]:
    """The value of every form of at least `least` nodes (`forms`), and those forms' nodes."""
    ix = GraphIndex(g)
    inits, found = ix.inits, _forms(ix, least)
    values = {name: np.ascontiguousarray(evaluate(name, nodes, inits, folder)) for name, nodes in found.items()}
    return values, [n for nodes in found.values() for n in nodes]


def replace_forms(g, gone: list, tensors: list) -> None:
    """Drop the nodes `gone` (forms), and what only they read, in place; the initializers
    `tensors` (named as the forms' outputs) take their place."""
    names, ids = {t.name for t in tensors}, {id(n) for n in gone}
    kept_nodes = [n for n in g.node if id(n) not in ids]
    del g.node[:]
    g.node.extend(kept_nodes)
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    kept = [i for i in g.initializer if i.name in read and i.name not in names]
    del g.initializer[:]
    g.initializer.extend(kept + list(tensors))
    vi = [v for v in g.value_info if v.name not in names]
    del g.value_info[:]
    g.value_info.extend(vi)


# handed to onnxruntime with the session options (add_external_initializers): in the serialized
# graph these are placeholders at this "location", never read from a file
HANDED = "edgekv:handed-at-load"


def handed_tensor(name: str, a: np.ndarray):
    """An initializer of `a`'s type and shape whose data comes with the session options (Handed)."""
    from onnx import TensorProto, helper

    t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(a.dtype), dims=list(a.shape),
                    data_location=TensorProto.EXTERNAL)
    for k, v in (("location", HANDED), ("offset", "0"), ("length", str(a.nbytes))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return t


@dataclass
class Handed:
    """Arrays (name, array) a session takes by reference; kept alive as long as it is."""
    buffers: list = field(default_factory=list, repr=False)

    def hand_to(self, ort, opts) -> list:
        """Give the session options the arrays; returns the OrtValues, to be kept as long as the session."""
        values = [ort.OrtValue.ortvalue_from_numpy(a) for _, a in self.buffers]
        if values:
            opts.add_external_initializers([n for n, _ in self.buffers], values)
        return values
