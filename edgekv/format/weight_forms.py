"""Weights a bundle stores smaller than the tensor a node reads: a constant subgraph ("form") of a
few integer and Cast ops over initializers, which onnxruntime folds into one tensor at load and
the TensorRT staging folds the same way (fold_forms). Three forms (docs/weights.md, "Codes at the
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


def forms(g, least: int = 1) -> dict[str, list]:
    """Every form of at least `least` nodes whose output a non-form node reads (or the graph
    returns): its output's name -> its nodes (the objects: protobuf's wrappers keep their id only
    while referenced)."""
    inits = {i.name for i in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    readers = [i for n in g.node if n.op_type not in FORM_OPS for i in n.input] + [o.name for o in g.output]
    found = {}
    for name in dict.fromkeys(readers):
        nodes = cone(name, producers, inits)
        if nodes and len(nodes) >= least:
            found[name] = nodes
    return found


def form_values(g, folder, least: int = 1) -> tuple[dict[str, np.ndarray], list]:
    """The value of every form of at least `least` nodes (`forms`), and those forms' nodes."""
    inits = {i.name: i for i in g.initializer}
    found = forms(g, least)
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


def fold_forms(model, folder) -> list[str]:
    """Replace (in place) every form whose output a non-form node reads (or the graph returns) by an
    initializer of that name and value, and drop what only forms read: the graph a float32-scale,
    8-bit-code exporter wrote, name for name. Returns the folded names (none: untouched)."""
    from onnx import numpy_helper

    values, gone = form_values(model.graph, folder)
    if values:
        replace_forms(model.graph, gone, [numpy_helper.from_array(a, name) for name, a in values.items()])
    return list(values)


# --- the exporter's side: the forms as nodes ---------------------------------------------------

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
