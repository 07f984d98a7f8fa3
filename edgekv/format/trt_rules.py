"""Static check of an ONNX graph against TensorRT's ONNX parser rules, for a TensorRT version.
The format layer's: the exporter holds every graph it writes to them and `edgekv check-trt`
(edgekv/tools/trt_check.py) holds any bundle or .onnx file to them.

No machine here can install TensorRT, so compatibility is checked from the parser's documented
rules (edgekv/data/trt_onnx_ops.json, transcribed from onnx-tensorrt's operator table):
supported ops and data types, inputs that must be build-time constants, INT8 only through Q/DQ
(never Cast), Q/DQ scales constant where the version requires it, per-channel Q/DQ only on
constant weights, UINT8 only at network I/O, default ONNX domain only, the opset range."""
from __future__ import annotations

import json
from pathlib import Path

from edgekv.format.trt_graph import TYPES, GraphFacts, Violation, block_size, graph_facts, read_onnx
from edgekv.graph.forms import forms
from edgekv.graph.passes.trt_staging import stage_weights

DATA = Path(__file__).parent.parent / "data" / "trt_onnx_ops.json"

_QUANTIZED = {"INT8", "INT4", "FP8", "FP4"}
# ops whose data input is not input 0, or whose input types are not what the table lists
_DATA_INPUT = {"Where": 1}
_SKIP_TYPES = {"Constant", "ConstantOfShape", "QuantizeLinear", "DequantizeLinear", "Cast", "CastLike", "Shape", "Size"}


def load_table() -> dict:
    return json.loads(DATA.read_text())


def check_model(model, trt: str = "10.3") -> list[Violation]:
    """`model`: an onnx.ModelProto or a path (weights are not loaded)."""
    import onnx

    table = load_table()
    if trt not in table["versions"]:
        raise ValueError(f"unknown TensorRT version {trt!r}; known: {', '.join(table['versions'])}")
    ver = table["versions"][trt]
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model), load_external_data=False)
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # type inference is a help, not a requirement
        pass
    opset, out = _check_opsets(model, ver, trt)
    model, forms = _forms_as_constants(model)
    out.extend(forms)
    facts = graph_facts(model.graph)
    for idx, n in enumerate(model.graph.node):
        out.extend(_check_node(n, n.name or f"node#{idx}", facts, table, ver, trt, opset))
    return out + _check_quantized_tensors(facts)


def _forms_as_constants(model):
    """(the graph with each weight form, edgekv/format/weight_forms.py, replaced by a weightless
    initializer of its value_info's type and shape, one line per form naming the staging that
    folds it). A bare model.onnx holds them; the engine build's staging folds them before TensorRT
    sees the graph (check_as_built checks that graph). The single Cast of an fp16 scale stays: the
    DequantizeLinear's scale rule names it."""
    from onnx import ModelProto, TensorProto

    g = model.graph
    infos = {v.name: v.type.tensor_type for v in g.value_info}
    found = {name: nodes for name, nodes in forms(g, least=2).items() if name in infos}
    out, gone, fake = [], set(), []
    for name, nodes in found.items():
        gone.update(id(n) for n in nodes)
        fake.append(TensorProto(name=name, data_type=infos[name].elem_type,
                                dims=[d.dim_value for d in infos[name].shape.dim]))
        ops = ", ".join(dict.fromkeys(n.op_type for n in nodes))
        out.append(Violation(name, "form", f"{name} is a weight stored compactly ({len(nodes)} constant nodes: {ops}); "
                             "the engine build's staging folds it into one tensor (check the bundle, not its bare "
                             "model.onnx: edgekv check-trt BUNDLE)"))
    if not gone:
        return model, []
    m = ModelProto()
    m.CopyFrom(model)
    nodes = [n for n, old in zip(m.graph.node, g.node) if id(old) not in gone]
    inside = {o for n, old in zip(m.graph.node, g.node) if id(old) in gone for o in n.output}
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    m.graph.initializer.extend(fake)
    infos = [v for v in m.graph.value_info if v.name not in inside]
    del m.graph.value_info[:]
    m.graph.value_info.extend(infos)
    return m, out


def _check_opsets(model, ver: dict, trt: str) -> tuple[int, list[Violation]]:
    """The default domain's opset (returned) within the version's range; no other domain imported."""
    out = []
    opset = 0
    int4 = any(i.data_type == 22 for i in model.graph.initializer)
    # INT4 block quantization exists from opset 21, which the docs' range stops short of (the json's note)
    max_opset = max(ver["max_opset"], ver["int4_opset"]) if int4 else ver["max_opset"]
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            opset = o.version
            if not ver["min_opset"] <= o.version <= max_opset:
                out.append(Violation("<model>", "opset", f"opset {o.version} outside TensorRT {trt}'s "
                                                          f"{ver['min_opset']}..{max_opset}"
                                                          + ("" if int4 else " (21 only for INT4 weights)")))
        else:
            out.append(Violation("<model>", "opset", f"non-standard domain {o.domain!r} imported"))
    return opset, out


def _check_node(n, name: str, f: GraphFacts, table: dict, ver: dict, trt: str, opset: int) -> list[Violation]:
    """One node: its domain, its op in the version's table, constant inputs, and its input types."""
    op = n.op_type
    if n.domain not in ("", "ai.onnx"):
        return [Violation(name, op, f"custom/contrib op from domain {n.domain!r} (TensorRT parses only the "
                                    "default ONNX domain without plugins)")]
    sup, unsup, not_yet = table["supported"], set(table["unsupported"]), set(ver["not_yet"])
    if op in unsup or op not in sup or op in not_yet:
        why = "not supported by TensorRT's ONNX parser" if op not in not_yet else f"not in TensorRT {trt}'s parser"
        return [Violation(name, op, why)]
    rule, constants = sup[op], f.constants
    out = []
    for k in rule.get("constant_inputs", []):
        if k < len(n.input) and n.input[k] and n.input[k] not in constants:
            out.append(Violation(name, op, f"input {k} ({n.input[k]}) must be a build-time constant"))
    if op == "Cast":
        return out + _check_cast(n, name, f.types, rule)
    if op in ("QuantizeLinear", "DequantizeLinear"):
        return out + _check_qdq(n, name, op, f, ver, trt, opset)
    if op == "Gather" and f.types.get(n.input[0]) == "INT8":
        return out + _check_int8_gather(n, name, f.constants, f.consumers)
    if op in _SKIP_TYPES:
        return out
    k = _DATA_INPUT.get(op, 0)
    t = f.types.get(n.input[k]) if k < len(n.input) else None
    if t and t not in rule["types"]:
        out.append(Violation(name, op, f"input type {t} not supported (TensorRT takes {', '.join(rule['types'])})"))
    return out


def _check_cast(n, name: str, types: dict, rule: dict) -> list[Violation]:
    to = next((a.i for a in n.attribute if a.name == "to"), None)
    src = types.get(n.input[0])
    if TYPES.get(to) in _QUANTIZED or src in _QUANTIZED:
        return [Violation(name, "Cast", f"Cast {src} -> {TYPES.get(to, to)}: TensorRT reaches quantized "
                                        "types only through QuantizeLinear/DequantizeLinear")]
    elif src and src not in rule["types"]:
        return [Violation(name, "Cast", f"Cast from {src} is not supported")]
    return []


def _check_quantized_tensors(f: GraphFacts) -> list[Violation]:
    """Quantized tensors exist only between Q and DQ; UINT8 only at the network's edge."""
    out, graph_io, constants = [], f.graph_io, f.constants
    for tname, t in f.types.items():
        prod = f.producers.get(tname)
        where = (prod.name, prod.op_type) if prod else (tname, "tensor")
        if t == "UINT4":
            out.append(Violation(*where, f"UINT4 tensor {tname}: TensorRT takes only signed INT4"))
        if t == "INT8":
            out.extend(_check_int8_tensor(tname, prod, where, f))
        if t == "UINT8" and tname not in graph_io and tname not in constants:
            out.append(Violation(*where, f"UINT8 tensor {tname} inside the network (TensorRT allows UINT8 only as network I/O)"))
    return out


def _check_int8_tensor(tname: str, prod, where: tuple[str, str], f: GraphFacts) -> list[Violation]:
    constants, consumers = f.constants, f.consumers
    # a Gather's INT8 rows are checked by _check_int8_gather (its table constant, its rows to DQ only)
    ok_src = (tname in f.graph_inputs or tname in constants or (prod is not None and prod.op_type == "QuantizeLinear")
              or (prod is not None and prod.op_type == "Gather" and prod.input[0] in constants))
    bad_use = [c for c in consumers.get(tname, []) if c.op_type != "DequantizeLinear"
               and not (c.op_type == "QuantizeLinear" and tname in c.input[2:] and tname in constants)
               and not (c.op_type == "Gather" and c.input[0] == tname and tname in constants)]
    out = []
    if not ok_src:
        out.append(Violation(*where, f"produces INT8 tensor {tname} other than by QuantizeLinear"))
    for c in bad_use:
        out.append(Violation(c.name, c.op_type, f"consumes INT8 tensor {tname}; only DequantizeLinear may"))
    return out


def _check_int8_gather(n, name, constants, consumers) -> list[Violation]:
    """TensorRT's IGatherLayer takes INT8 data (its operator reference); the ONNX parser is only
    trusted with it for a constant table whose gathered rows go straight to DequantizeLinear."""
    out = []
    if n.input[0] not in constants:
        out.append(Violation(name, "Gather", f"INT8 Gather on {n.input[0]}, which is not a constant table"))
    for c in consumers.get(n.output[0], []):
        if c.op_type != "DequantizeLinear":
            out.append(Violation(c.name, c.op_type, f"consumes the INT8 rows {n.output[0]}; only DequantizeLinear may"))
    return out


def _check_blocked_dq(n, name, op, types, constants, shapes, ver, trt, opset) -> list[Violation]:
    """Block-wise DequantizeLinear: TensorRT takes it only for INT4, on a 2-D constant, from opset 21."""
    out = []
    src = types.get(n.input[0])
    if op == "QuantizeLinear":
        return [Violation(name, op, "block-wise QuantizeLinear: TensorRT quantizes block-wise only weights (DQ)")]
    if src != "INT4":
        out.append(Violation(name, op, f"block-wise DequantizeLinear of {src}: TensorRT takes block quantization "
                                       "only for INT4"))
    if n.input[0] not in constants:
        out.append(Violation(name, op, "block-wise DequantizeLinear is allowed only on constant weights"))
    elif len(shapes.get(n.input[0], [])) != 2:
        out.append(Violation(name, op, f"block-wise DequantizeLinear on a {len(shapes.get(n.input[0], []))}-D "
                                       "tensor: TensorRT takes only 2-D weights"))
    if opset < ver["int4_opset"]:
        out.append(Violation(name, op, f"block-wise DequantizeLinear needs opset {ver['int4_opset']} "
                                       f"(the graph imports {opset})"))
    return out


def _scale_rule(scale: str, f: GraphFacts, trt: str) -> str:
    """Why a Q/DQ scale that is not a build-time constant is refused; a bundle's fp16 scale behind
    its Cast to float32 is named as such: the TensorRT staging (widen_half_scales) folds it."""
    prod = f.producers.get(scale)
    if prod is not None and prod.op_type == "Cast" and prod.input and f.types.get(prod.input[0]) == "FP16" \
            and prod.input[0] in f.constants:
        return (f"scale {scale} is a Cast of the fp16 constant {prod.input[0]}; TensorRT {trt} needs the scale "
                "itself constant: the engine build's staging folds the Cast (check the bundle, not its bare "
                "model.onnx: edgekv check-trt BUNDLE)")
    return (f"scale {scale} is computed at run time; TensorRT {trt} needs a build-time constant "
            "(runtime scales arrive in 10.13)")


def _check_qdq(n, name, op, f: GraphFacts, ver, trt, opset=0) -> list[Violation]:
    types, constants, shapes = f.types, f.constants, f.shapes
    out = []
    src = types.get(n.input[0])
    if src == "INT4" and opset < ver["int4_opset"]:
        out.append(Violation(name, op, f"INT4 needs opset {ver['int4_opset']} (the graph imports {opset})"))
    if block_size(n) > 0:
        out.extend(_check_blocked_dq(n, name, op, types, constants, shapes, ver, trt, opset))
    scale = n.input[1] if len(n.input) > 1 else ""
    zp = n.input[2] if len(n.input) > 2 else ""
    if ver["qdq_scale_must_be_constant"] and scale not in constants:
        out.append(Violation(name, op, _scale_rule(scale, f, trt)))
    if zp and zp not in constants:
        out.append(Violation(name, op, f"zero point {zp} must be a build-time constant"))
    per_channel = scale in shapes and len(shapes[scale]) > 0 and int(_prod(shapes[scale])) > 1 and not block_size(n)
    if per_channel and op == "DequantizeLinear" and n.input[0] not in constants:
        out.append(Violation(name, op, "per-channel DequantizeLinear is allowed only on constant weights"))
    if per_channel and op == "QuantizeLinear" and n.input[0] not in constants:
        out.append(Violation(name, op, "per-channel QuantizeLinear is allowed only on constant weights"))
    if op == "DequantizeLinear" and src and src not in _QUANTIZED:
        out.append(Violation(name, op, f"input type {src}: TensorRT dequantizes only quantized types"))
    if op == "QuantizeLinear" and src and src not in ("FP32", "FP16", "BF16"):
        out.append(Violation(name, op, f"input type {src} not supported"))
    return out


def _prod(xs):
    p = 1
    for x in xs:
        p *= x
    return p


def check_as_built(path: Path, trt: str, rewrite) -> tuple[list[Violation], list[str]]:
    """Check the graph at `path` as the engine build hands it to TensorRT: its fp16 block scales'
    Casts folded into float32 initializers and its packed weights unpacked (stage_weights), then `rewrite(model, folder)`
    (edgekv/runtime/backends/engines.py's tensorrt_graph: 8-bit block-wise weights requantized per
    channel) changes it in place and returns the converted weights' names. Returns the violations
    and those names. The rewrite is passed in: it is the runtime's, a layer above this one."""
    from edgekv.errors import EdgeKVError

    model = read_onnx(path)
    try:
        stage_weights(model, path.parent)  # as the engine build's staging: fp16 scales widened, packed codes unpacked
        converted = rewrite(model, path.parent)
    except (OSError, ValueError, RuntimeError) as e:  # the weights beside the graph missing or unreadable
        raise EdgeKVError(f"{path}: cannot read its weights to check them as the engine build would "
                          f"({type(e).__name__}: {e})") from None
    return check_model(model, trt), converted
