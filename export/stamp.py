"""Trace each kind of layer once and stamp it: the ONNX graph of an N-layer model from the graph
of a view holding the first layer of each kind (docs/graph.md, "Stamped layers").

torch.export's time grows with the layers it traces (about 3 s a layer on 2 cores, against ~5 s
fixed), and every layer of one kind is the same nodes over its own weights and cache: a layer's
graph depends on its RoPE table (rotary, NoPE, local) and nothing else but its tensors. So the
exporter traces the view and copies each traced layer's nodes for every layer of its kind,
renaming its values, its past/present and its weights (`layers.J.` -> `layers.I.`, the bytes from
the model's own tensors). What this does not recognise (a traced layer whose nodes are not one
run, a residual stream that is not the one float [B, S, E] value crossing between layers)
returns None, and the caller traces the whole model."""
from __future__ import annotations

import ast
import re

import onnx
from onnx import helper

from export.model import Transformer

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")
_SCOPE = re.compile(r"(?:^|\.)layers\.(\d+)$")  # a block's module scope (LocalMaskGraph's adds "model.")
_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def layer_kinds(model: Transformer) -> list:
    """Each layer's kind: what its exported nodes depend on besides its weights and cache."""
    return [(model.layer_rope[i], i in model.cfg.local_layers) for i in range(model.cfg.n_layers)]


def representatives(model: Transformer) -> list[int]:
    """The first layer of each kind, in layer order."""
    kinds = layer_kinds(model)
    return [i for i, k in enumerate(kinds) if k not in kinds[:i]]


def _scope(node: onnx.NodeProto) -> int | None:
    """The traced layer a node belongs to (torch's module scope `layers.J`), or None."""
    for p in node.metadata_props:
        if p.key == "pkg.torch.onnx.name_scopes":
            layer = next((m for m in map(_SCOPE.search, ast.literal_eval(p.value)) if m), None)
            return int(layer.group(1)) if layer else None
    return None


def _is_hidden(vi: onnx.ValueInfoProto | None, hidden: int) -> bool:
    """A float [B, S, hidden] value: the residual stream."""
    if vi is None:
        return False
    t = vi.type.tensor_type
    return t.elem_type in _FLOATS and len(t.shape.dim) == 3 and t.shape.dim[2].dim_value == hidden


def _rename_layer(name: str, j: int, i: int) -> str:
    return _LAYER.sub(lambda m: f"{m.group(1)}layers.{i}.", name, count=1) if _layer_of(name) == j else name


def _layer_of(name: str) -> int | None:
    m = _LAYER.search(name)
    return int(m.group(2)) if m else None


def _invariant(nodes: list, varying: set) -> set:
    """The values of a traced layer's nodes that depend on none of `varying` (its residual
    stream, its cache and its weights): shape arithmetic and constants, the same in every copy."""
    out = set()
    for n in nodes:  # topological order
        if not any(v in varying for v in n.input):
            out.update(n.output)
        else:
            varying.update(n.output)
    return out


def _model_key(name: str, tensors: dict) -> str | None:
    """The model's own name for an initializer (LocalMaskGraph's adds a "model." prefix)."""
    return next((k for k in (name, name.partition(".")[2]) if k in tensors), None)


def _copy(node, name: str, inputs: list[str], outputs: list[str]) -> onnx.NodeProto:
    c = onnx.NodeProto()
    c.CopyFrom(node)
    c.name = name
    c.input[:] = inputs
    c.output[:] = outputs
    return c


def stamp_layers(traced: onnx.ModelProto, model: Transformer, reps: list[int], view_names: dict,
                 names: dict) -> tuple[onnx.ModelProto, dict] | None:
    """The graph of `model` (all its layers) from `traced`, the graph of its view with layers
    `reps`; view_names / names: the contract's I/O names (io_names) of the view and of the model.
    Returns (graph, {initializer: array}): the copies' initializers hold no bytes in the graph
    (the model's tensors, as numpy views, are attached by the caller: no second copy of the
    weights while the graph is folded and serialized)."""
    g, cfg = traced.graph, model.cfg
    kinds = layer_kinds(model)
    traced_of_kind = {kinds[r]: j for j, r in enumerate(reps)}
    scopes = [_scope(n) for n in g.node]
    inside = [k for k, s in enumerate(scopes) if s is not None]
    run = scopes[inside[0]:inside[-1] + 1] if inside else [None]
    if None in run or run != sorted(run):
        return None  # each traced layer's nodes one run, in layer order
    pre, post = list(g.node[:inside[0]]), list(g.node[inside[-1] + 1:])
    body = {j: [n for n, s in zip(g.node, scopes) if s == j] for j in range(len(reps))}
    made = {j: [o for n in body[j] for o in n.output] for j in body}
    maker = {o: j for j, outs in made.items() for o in outs}
    vinfo = {v.name: v for v in [*g.value_info, *g.input, *g.output]}
    per = len(names["past"]) // cfg.n_layers  # past tensors per layer (K and V, scales too)

    def io_of(group: str, i: int, view: bool = False) -> list[str]:
        return (view_names if view else names)[group][i * per:(i + 1) * per]

    # a view's past/present name means its traced layer's original one wherever else it is read
    to_full = {v: f for j, r in enumerate(reps) for grp in ("past", "present")
               for v, f in zip(io_of(grp, j, True), io_of(grp, r))}

    def hidden(v: str) -> bool:
        return _is_hidden(vinfo.get(v), cfg.hidden_size)

    x_in, x_out = {}, {}
    for j in body:  # the residual stream into each traced layer and out of it
        own = set(made[j])
        into = {v for n in body[j] for v in n.input
                if v and v not in own and hidden(v) and maker.get(v, -1) == j - 1}
        readers = body[j + 1] if j + 1 in body else post
        out = {v for n in readers for v in n.input if maker.get(v) == j and hidden(v)}
        if len(into) != 1 or len(out) != 1:
            return None
        x_in[j], x_out[j] = into.pop(), out.pop()

    tensors = {**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False))}

    def own(name: str) -> bool:  # a layer's tensor; not a constant torch lifted out of forward (same in every copy)
        return _layer_of(name) is not None and _model_key(name, tensors) is not None

    weights = {}  # the model's tensors, attached by the caller (no copy of their bytes in the graph)
    inits = []
    for t in g.initializer:  # outside the layers: the model's own tensors (embedding, head) by name too
        key = None if _layer_of(t.name) is not None else _model_key(t.name, tensors)
        if key is not None:
            weights[t.name] = tensors[key].detach().cpu().numpy()
            t = _placeholder(t.name, weights[t.name])
        if not own(t.name):
            inits.append(t)
    layer_inits = {j: [t.name for t in g.initializer if own(t.name) and _layer_of(t.name) == j] for j in body}
    nodes = [_copy(n, n.name, [to_full.get(v, v) for v in n.input], list(n.output)) for n in pre]
    value_info = [v for v in g.value_info if v.name not in maker]
    latest: dict[str, str] = {}  # a traced layer's value -> its newest copy's name (read by others)
    shared = {j: _invariant(body[j], {x_in[j], *io_of("past", j, True), *layer_inits[j]}) for j in body}
    first: dict[str, str] = {}  # a layer-invariant value -> its first copy's name
    x = x_in[0]
    for i in range(cfg.n_layers):
        j = traced_of_kind[kinds[i]]
        ren = {x_in[j]: x, **dict(zip(io_of("past", j, True), io_of("past", i))),
               **dict(zip(io_of("present", j, True), io_of("present", i))),
               **{v: first[v] for v in shared[j] if v in first}}
        for name in layer_inits[j]:
            new = _rename_layer(name, j, i)
            ren[name] = new
            weights[new] = tensors[_model_key(new, tensors)].detach().cpu().numpy()
            inits.append(_placeholder(new, weights[new]))
        ren.update({v: f"{v}__{i}" for v in made[j] if v not in ren})
        for n in body[j]:
            if all(v in first for v in n.output):
                continue  # computed once, as the traced graph does: the first copy's outputs are read
            nodes.append(_copy(n, f"{n.name}__{i}", [ren.get(v) or latest.get(v) or to_full.get(v, v) for v in n.input],
                               [ren[v] for v in n.output]))
        first.update({v: ren[v] for v in shared[j] if v not in first})
        for v in made[j]:
            if v in vinfo and ren[v] not in names["present"]:
                vi = onnx.ValueInfoProto()
                vi.CopyFrom(vinfo[v])
                vi.name = ren[v]
                value_info.append(vi)
        latest.update({v: ren[v] for v in made[j]})
        x = ren[x_out[j]]
    latest[x_out[len(reps) - 1]] = x
    nodes += [_copy(n, n.name, [latest.get(v) or to_full.get(v, v) for v in n.input], list(n.output)) for n in post]

    def value(name: str, group: str, table: dict) -> onnx.ValueInfoProto:
        i, k = divmod(names[group].index(name), per)
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(table[io_of(group, traced_of_kind[kinds[i]], True)[k]])
        vi.name = name
        return vi

    ins, outs = {v.name: v for v in g.input}, {v.name: v for v in g.output}
    graph = helper.make_graph(
        nodes, g.name,
        [ins[n] for n in names["inputs"]] + [value(n, "past", ins) for n in names["past"]],
        [outs["logits"]] + [value(n, "present", outs) for n in names["present"]],
        initializer=inits, value_info=value_info)
    out = onnx.ModelProto()
    out.CopyFrom(traced)
    out.graph.CopyFrom(graph)
    return out, weights


def _placeholder(name: str, array) -> onnx.TensorProto:
    """An initializer's name, type and shape, its bytes left out (stamp_layers' caller attaches them)."""
    t = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
    t.dims.extend(array.shape)
    return t
