"""torch -> ONNX for the graph contract, and the pass that makes its INT8 TensorRT-legal."""
from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnxscript import ir  # onnx_ir, as onnxscript (the export extra) exports it
import torch
from onnx import TensorProto, helper, numpy_helper

from edgekv.errors import note
from edgekv.format.bundle import io_names, layer_of, local_slots
from export.model import LocalMaskGraph, Transformer, causal_mask, linear_key_positions
from export.stamp import representatives, stamp_layers

OPSET = 18  # every graph; one with INT4 weights is relabelled 21 (docs/graph.md: why, and why that is safe)
OPSET_INT4 = 21


def export_onnx(model: Transformer, weights: dict | None = None, stamp: bool = True) -> onnx.ModelProto:
    """Export with every dimension that varies at run time dynamic (B, S, P, K). weights: name ->
    QuantWeight for the weights stored quantized (the model must hold their dequantized values).
    stamp: trace one layer of each kind and copy it for the others (export/stamp.py); False (or a
    graph stamping does not recognise) traces every layer."""
    names = io_names(model.cfg.n_layers, model.scheme, bool(model.cfg.local_layers))
    prog = None
    reps = representatives(model)
    if stamp and len(reps) < model.cfg.n_layers:
        view = model.with_layers(reps)
        stamped = stamp_layers(_trace(view).model_proto, model, reps,
                               io_names(len(reps), model.scheme, bool(view.cfg.local_layers)), names)
        if stamped is not None:
            graph, tensors = stamped
            prog = ir.serde.deserialize_model(graph)
            for name, array in tensors.items():
                prog.graph.initializers[name].const_value = ir.Tensor(array, name=name)
        else:
            note("  (layers not stamped: the traced graph's layers were not recognised; tracing all of them)")
    if prog is None:
        prog = _trace(model).model
    # Fold constant subgraphs only (TensorRT needs axes etc. as constants; the full onnxscript
    # optimizer pass is slow and changes nothing onnxruntime needs: docs/graph.md)
    import onnxscript.optimizer as opt

    opt.fold_constants(prog)
    opt.remove_unused_nodes(prog)
    m = ir.serde.serialize_model(prog)
    m = int8_casts_to_qdq(m)
    if weights:
        m = store_quantized_weights(m, model, weights)
    name_dims(m, names, model.cfg.local_layers)
    return m


def _trace(model: Transformer):
    """torch.export of `model` to ONNX (an ONNXProgram), as traced: nothing folded yet."""
    cfg = model.cfg
    local = bool(cfg.local_layers)  # a second mask input for the sliding-window layers
    names = io_names(cfg.n_layers, model.scheme, local)
    B, S, P = 2, 3, 5  # example sizes > 1 so that torch.export does not specialize them
    dtype = next(model.parameters()).dtype
    positions = torch.arange(P, P + S).repeat(B, 1)
    mask = causal_mask(P, S, B).clone()
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(0))  # the caller's RNG untouched
    args = (ids, positions, mask, torch.tensor([[S - 2, S - 1]] * B))
    # Dim.DYNAMIC lets torch.export find the relations itself (key_mask is [B, S, P + S])
    d = torch.export.Dim.DYNAMIC
    specs = ({0: d, 1: d}, {0: d, 1: d}, {0: d, 1: d, 2: d}, {0: d, 1: d})
    graph = model
    past = model.past_like(P, B, dtype)
    if local:  # local_key_mask [B, S, L + S], after logits_index (the window rule, from the runtime)
        # the local layers' past is L slots, its own length (format 4: a windowed cache binds
        # only the window there). L != P in the example, or torch.export would take them for one
        # dimension; the local slots hold the L positions just before the new tokens
        L = P - 1
        keys = linear_key_positions(positions, L + S)
        window = (positions[:, :, None] - keys[:, None, :]) < cfg.sliding_window
        args, specs, graph = (*args, causal_mask(L, S, B) & window), (*specs, {0: d, 1: d, 2: d}), LocalMaskGraph(model)
        short = model.past_like(L, B, dtype)
        past = [short[j] if layer_of(name) in cfg.local_layers else t for j, (name, t) in enumerate(zip(names["past"], past))]
    args = (*args, *past)
    past_specs = tuple({0: d, 1: d} for _ in names["past"])  # one nested tuple for *past
    dynamic_shapes = (*specs, past_specs)
    options = dict(input_names=names["inputs"] + names["past"], output_names=["logits"] + names["present"],
                   dynamic_shapes=dynamic_shapes, optimize=False, verbose=False, opset_version=OPSET)
    with warnings.catch_warnings(), torch.no_grad(), _heap_frozen():
        warnings.simplefilter("ignore")
        export = _exporter_core()
        if export is None:
            return torch.onnx.export(graph, args, dynamo=True, external_data=True, **options)
        return export(graph, args, None, registry=_torchlib_registry(), **options)


@contextlib.contextmanager
def _heap_frozen():
    """The objects that exist before the trace left out of the garbage collector's passes during it
    (gc.freeze; gc.unfreeze after, so they are collected as before). The trace makes millions of
    short-lived objects, and each full pass also walked the whole heap (torch, the model): 0.5-1 s
    CPU a trace of a tiny model, ~0.15 s frozen. Nothing is kept alive that would not be; the graph
    is the same. A freeze someone else holds is left alone (unfreeze would undo it)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@functools.lru_cache(maxsize=None)
def _exporter_core():
    """torch.onnx's own exporter behind torch.onnx.export(dynamo=True) (a private module), or None.
    torch.onnx.export builds its registry of torchlib functions anew on every call (~0.5 s CPU, and
    the garbage collector's passes over it during the trace); the export here is that call with
    one registry kept for the process: the same ONNX graph (checked on torch 2.13), ~18 % less CPU
    a trace of a tiny model. Where the private names are missing or take other arguments (other
    torch versions), None: _trace calls torch.onnx.export as before."""
    try:
        from torch.onnx._internal.exporter import _constants, _core, _registration

        params = inspect.signature(_core.export).parameters
        from_torchlib = _registration.ONNXRegistry.from_torchlib
        if "opset_version" not in inspect.signature(from_torchlib).parameters:
            return None
        # torch.onnx.export's registry: torchlib's opset when asked for a lower one (_compat.py)
        if OPSET < _constants.TORCHLIB_OPSET:
            return None
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    wanted = ("registry", "dynamic_shapes", "input_names", "output_names", "optimize", "verbose", "opset_version")
    return _core.export if all(p in params for p in wanted) else None


@functools.lru_cache(maxsize=None)
def _torchlib_registry():
    """The registry torch.onnx.export builds for OPSET, built once (export reads it, never adds to it)."""
    from torch.onnx._internal.exporter import _registration

    return _registration.ONNXRegistry.from_torchlib(opset_version=OPSET)


def store_quantized_weights(m: onnx.ModelProto, model: Transformer, weights: dict) -> onnx.ModelProto:
    from export.weights_graph import needs_opset_21, quantize_initializers

    params = dict(model.named_parameters(remove_duplicate=False))
    targets = {name: (params[name].detach().cpu().numpy(), q) for name, q in weights.items()}
    m = quantize_initializers(m, targets, embed="embed.weight")
    if needs_opset_21(weights, "embed.weight"):
        # ops change between 18 and 21 only by added types/attributes (docs/graph.md), so the
        # graph torch wrote at 18 means the same at 21; onnx.checker verifies it after saving
        for o in m.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = OPSET_INT4
        m.ir_version = max(m.ir_version, 10)
    return m


def name_dims(m: onnx.ModelProto, names: dict, local_layers=()) -> None:
    """Give the dynamic dimensions the contract's names (torch.export calls them s0, s1, ...):
    the local layers' past has its own length, `local_past` (docs/graph.md)."""
    dims = {"input_ids": ["batch", "seq"], "position_ids": ["batch", "seq"], "key_mask": ["batch", "seq", "total"],
            "local_key_mask": ["batch", "seq", "local_total"],
            "logits_index": ["batch", "nlogits"], "logits": ["batch", "nlogits"]}
    for n in names["past"]:
        dims[n] = ["local_past" if layer_of(n) in local_layers else "past", "batch"]
    for n in names["present"]:
        dims[n] = ["seq", "batch"]
    for v in [*m.graph.input, *m.graph.output]:
        for d, label in zip(v.type.tensor_type.shape.dim, dims.get(v.name, [])):
            if not d.HasField("dim_value"):
                d.dim_param = label


def save_onnx(m: onnx.ModelProto, path: Path) -> None:
    onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)


def _const(name: str, value, dtype) -> TensorProto:
    return numpy_helper.from_array(np.array(value, dtype=dtype), name)


WEIGHT_BYTES = 1024  # initializers above this size are weights: shape inference needs their type and dims only


def element_types(m: onnx.ModelProto) -> dict:
    """name -> element type of every value in `m`, by onnx's shape inference over a stand-in of
    `m` whose weights have no bytes: inference serializes the whole model into C++ (about a second
    per 140 MB of float weights) and reads initializer values only for shape-like integer inputs
    (Reshape's shape, Slice's starts), which the stand-in keeps. `m` is read, never changed, and
    no weight's bytes are copied (reading a protobuf bytes field copies it: sizes by ByteSize)."""
    stand_in = onnx.ModelProto(ir_version=m.ir_version, opset_import=m.opset_import, functions=m.functions)
    g = stand_in.graph
    for field in ("node", "input", "output", "value_info"):
        getattr(g, field).extend(getattr(m.graph, field))
    for init in m.graph.initializer:
        if init.data_type not in (TensorProto.INT64, TensorProto.INT32) and init.ByteSize() > WEIGHT_BYTES:
            g.initializer.add(name=init.name, data_type=init.data_type, dims=init.dims)
        else:
            g.initializer.append(init)
    inferred = onnx.shape_inference.infer_shapes(stand_in).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.input, *inferred.value_info, *inferred.output]}
    types.update((init.name, init.data_type) for init in m.graph.initializer)
    return types


def int8_casts_to_qdq(m: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite every Cast to INT8 as QuantizeLinear(x, 1.0, 0) and every Cast from INT8 as
    DequantizeLinear(x, 1.0, 0). TensorRT's parser takes INT8 only through Q/DQ with a constant
    scale; a unit per-tensor scale is legal in every TensorRT 10.x and exact in onnxruntime
    (the graph already rounds and clips to [-127, 127] before the cast)."""
    types = element_types(m)
    g = m.graph
    new_nodes, consts = [], {}

    def const(name, value, dtype):
        if name not in consts:
            consts[name] = _const(name, value, dtype)
        return name

    one = const("qdq_unit_scale", 1.0, np.float32)
    zero = const("qdq_zero_point", 0, np.int8)
    for n in g.node:
        if n.op_type != "Cast":
            new_nodes.append(n)
            continue
        to = next(a.i for a in n.attribute if a.name == "to")
        src = types.get(n.input[0])
        if to == TensorProto.INT8:
            x = n.input[0]
            if src != TensorProto.FLOAT:  # QuantizeLinear at opset 18 takes float32 input
                new_nodes.append(helper.make_node("Cast", [x], [x + "_f32"], to=TensorProto.FLOAT, name=n.name + "_f32"))
                x = x + "_f32"
            new_nodes.append(helper.make_node("QuantizeLinear", [x, one, zero], list(n.output), name=n.name + "_q"))
        elif src == TensorProto.INT8:
            if to == TensorProto.FLOAT:
                new_nodes.append(helper.make_node("DequantizeLinear", [n.input[0], one, zero], list(n.output), name=n.name + "_dq"))
            else:  # DequantizeLinear at opset 18 yields float32: cast on to the target
                mid = n.output[0] + "_f32"
                new_nodes.append(helper.make_node("DequantizeLinear", [n.input[0], one, zero], [mid], name=n.name + "_dq"))
                new_nodes.append(helper.make_node("Cast", [mid], list(n.output), to=to, name=n.name))
        else:
            new_nodes.append(n)
    # Shape() of an INT8 input would make TensorRT touch a quantized tensor outside Q/DQ: take the
    # shape of a dequantized copy instead (same shape; TensorRT drops the unused math)
    fixed = []
    for n in new_nodes:
        if n.op_type == "Shape" and types.get(n.input[0]) == TensorProto.INT8:
            tmp = n.input[0] + "_dq_for_shape_" + str(len(fixed))
            fixed.append(helper.make_node("DequantizeLinear", [n.input[0], one, zero], [tmp], name=n.name + "_dq"))
            n.input[0] = tmp
        fixed.append(n)
    new_nodes = fixed
    del g.node[:]
    g.node.extend(new_nodes)
    g.initializer.extend(consts.values())
    del g.value_info[:]  # stale after the rewrite; onnx re-infers on demand
    return m


def window_fields(cfg) -> dict:
    """The manifest's model.* fields of the sliding-window layers (none for a model without them)."""
    if not cfg.local_layers:
        return {}
    return {"local_layers": list(cfg.local_layers), "sliding_window": int(cfg.sliding_window)}


def windowed_kv_fields(cfg, scheme, float_bytes: int) -> dict:
    """The manifest's kv.* fields of the windowed cache (format 4; none without local layers):
    the slots a local layer keeps, the global layers' bytes per token, the local layers' fixed
    bytes per sequence."""
    if not cfg.local_layers:
        return {}
    n_local = len(cfg.local_layers)
    per = lambda layers: scheme.bytes_per_token(layers, cfg.n_kv_heads, cfg.head_dim, float_bytes)  # noqa: E731
    slots = local_slots(int(cfg.sliding_window))
    return {"local_slots": slots, "global_bytes_per_token": per(cfg.n_layers - n_local),
            "local_bytes": per(n_local) * slots}
