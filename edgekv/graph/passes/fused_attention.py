"""fused-attention: a bundle's plain graph rewritten into onnxruntime's fused ops (docs/fused.md).

- per layer, one com.microsoft GroupQueryAttention in place of the plain attention block (RoPE,
  quantize of the new K/V, the two attention products, softmax, the mask), fed the layer's own
  packed q|k|v projection and writing the layer's cache (what is matched: fused_match.py);
- the residual Add before an RMSNorm folded with it into SkipSimplifiedLayerNormalization.

Everything else is the bundle's own graph, its weights read from the bundle's data file. What is
new is tiny and derived: the RoPE cos/sin tables (from the graph's own inv_freq constant) and, for
a static int8 cache, the layer's calibrated scales in the op's PER_CHANNEL shape [1, Hkv, 1, D].
The fused graph's I/O: backends/fused.py's docstring."""
from __future__ import annotations

import numpy as np

from edgekv.graph.index import GraphIndex, prune_unneeded
from edgekv.graph.passes.fused_match import (BIAS, BIAS_LOCAL, FLOAT_TYPES, MASKS, MS, SEQLENS, TOTAL, Layer,
                                             NotFusable, _match_layer, _rmsnorm_input)


class FusedAttention:
    """The pass. `config`: the manifest's model (n_layers, n_heads, n_kv_heads, head_dim,
    hidden_size, local_layers); `kind`: the cache, "float" or "static" (the caller refuses the
    rest); `dtype`: the graph's float type; `positions`: rows of the RoPE tables. The report is
    the pass itself: `layers` (each layer as matched), `skip_norms`, `changed`. Raises NotFusable
    where a layer is not what the op can express (the graph is then not to be used)."""
    name = "fused-attention"

    def __init__(self, config: dict, kind: str, dtype: str, positions: int, skip_norm: bool = True):
        self.config, self.kind, self.dtype, self.positions, self.skip_norm = config, kind, dtype, positions, skip_norm
        self.layers: list[Layer] = []
        self.skip_norms = 0
        self.changed = False

    def apply(self, g: GraphIndex) -> "FusedAttention":
        m = self.config
        self.layers = [_match_layer(g, i, m, self.kind, self.dtype, self.positions) for i in range(m["n_layers"])]
        _emit_attention(g, self.layers, m, self.kind, self.dtype)
        self.skip_norms = _emit_skip_norms(g) if self.skip_norm else 0
        _prune(g)
        _check_fused(g, m["n_layers"])
        self.changed = True
        return self


def _emit_attention(g: GraphIndex, layers: list[Layer], m: dict, kind: str, dtype: str) -> None:
    helper, nh = g.onnx.helper, g.nh
    H, Hkv, D = m["n_heads"], m["n_kv_heads"], m["head_dim"]
    # the global layers' bias, and the sliding-window layers' where there are any
    bias = {local: _bias_as(g, BIAS_LOCAL if local else BIAS, dtype) for local in {False} | {L.local for L in layers}}
    base = dict(num_heads=H, kv_num_heads=Hkv, rotary_interleaved=0)
    if kind == "static":
        base.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
    tables: dict[tuple, tuple[str, str]] = {}  # the graph's (cos, sin) -> the op's cache initializers
    new_nodes = []
    renames = {}
    for L in layers:
        i = L.i
        rotary = ["", "", ""]  # cos_cache, sin_cache, position_ids: only where the op rotates
        if L.rotary == "op":
            if L.tables[:2] not in tables:
                names = tuple(f"fused.{w}_cache" + (f".{len(tables)}" if tables else "") for w in ("cos", "sin"))
                g.g.initializer.extend([nh.from_array(np.ascontiguousarray(t, dtype), n)  # [positions, r/2], the op's T
                                        for t, n in zip(L.tables[2:], names)])
                tables[L.tables[:2]] = names
            rotary = [*tables[L.tables[:2]], "position_ids"]
        packed = L.qkv if L.qk is None else _pack_qkv(g, new_nodes, i, L.qk, L.v)
        ins = [packed, "", "", f"past.{i}.key", f"past.{i}.value", SEQLENS, TOTAL, *rotary, bias[L.local], ""]
        if kind == "static":
            ins += [f"fused.{i}.k_scale", f"fused.{i}.v_scale"]
            g.g.initializer.extend([nh.from_array(L.k_scale.astype(np.float32).reshape(1, Hkv, 1, D), ins[-2]),
                                    nh.from_array(L.v_scale.astype(np.float32).reshape(1, Hkv, 1, D), ins[-1])])
        out = f"fused.{i}.attn"
        own = {} if L.scale is None else {"scale": L.scale}
        new_nodes.append(helper.make_node("GroupQueryAttention", ins, [out, f"fused.{i}.key", f"fused.{i}.value"],
                                          name=f"fused.{i}.gqa", domain=MS, do_rotary=int(L.rotary == "op"),
                                          **base, **own))
        renames[L.attn_out] = out
    # consumers of the old attention outputs read the fused ones; the old present.* are renamed
    # away so the fused node's outputs can take the graph outputs' names
    for n in g.g.node:
        for k, x in enumerate(n.input):
            if x in renames:
                n.input[k] = renames[x]
    for L in layers:
        for which in ("key", "value"):
            old = f"present.{L.i}.{which}"
            g.rename(old, old + ".plain", reindex=False)
            for n in new_nodes:  # (a float cache's v is present.{i}.value itself: _pack_qkv reads it)
                for k, x in enumerate(n.input):
                    if x == old:
                        n.input[k] = old + ".plain"
                for k, o in enumerate(n.output):
                    if o == f"fused.{L.i}.{which}":
                        n.output[k] = old
    g.g.node.extend(new_nodes)
    _batch_from_positions(g)
    _sizes_from_ids(g)
    _set_io(g, layers, m, kind)
    if not any(o.domain == MS for o in g.model.opset_import):
        g.model.opset_import.append(helper.make_opsetid(MS, 1))
    g.reindex()


def _bias_as(g: GraphIndex, bias: str, dtype: str) -> str:
    """A bias input in the op's T: the graph input stays float32 (what the runtime feeds for every
    bundle); a float16 graph casts it once (0 and -inf are exact in float16)."""
    if dtype == "float32":
        return bias
    name = f"{bias}.{dtype}"
    g.g.node.append(g.onnx.helper.make_node("Cast", [bias], [name], name=name, to=FLOAT_TYPES[dtype]))
    return name


def _pack_qkv(g: GraphIndex, nodes: list, i: int, qk: str, v: str) -> str:
    """The op's packed query [B, S, (H+2Hkv)*D] from the layer's q|k [S, B, H+Hkv, D] (after its
    norm, or its RoPE where the graph keeps that) and v [S, B, Hkv, D]."""
    helper, p = g.onnx.helper, f"fused.{i}.qkv"
    g.g.initializer.append(g.nh.from_array(np.array([0, 0, -1], np.int64), p + ".shape"))
    nodes += [helper.make_node("Concat", [qk, v], [p + ".sb"], name=p + ".concat", axis=2),  # [S, B, H+2Hkv, D]
              helper.make_node("Transpose", [p + ".sb"], [p + ".bs"], name=p + ".transpose", perm=[1, 0, 2, 3]),
              helper.make_node("Reshape", [p + ".bs", p + ".shape"], [p], name=p + ".reshape")]
    return p


def _batch_from_positions(g: GraphIndex) -> None:
    """The graph as exported may read the batch size off a cache tensor (Shape(past.{i}.*)[1:2] of
    the slot-major [P, B, Hkv, D]); the fused cache is [B, Hkv, C, D], so those read position_ids'
    [B, S] dim 0 instead. Any other dim of the plain cache's shape has no fused equivalent."""
    for n in g.g.node:
        if n.op_type == "Shape" and n.input[0].startswith("past."):
            if (g.attr(n, "start", 0), g.attr(n, "end")) != (1, 2):
                raise NotFusable(f"{n.name}: reads the plain cache's shape (not only its batch size)")
            n.input[0] = "position_ids"
            del n.attribute[:]
            n.attribute.extend([g.onnx.helper.make_attribute("start", 0), g.onnx.helper.make_attribute("end", 1)])


def _sizes_from_ids(g: GraphIndex) -> None:
    """The graph as exported may read the call's sizes off a mask (Gemma 3's: Shape(local_key_mask)[1:2],
    the new tokens S); the fused graph has no mask input, so those read input_ids' [B, S] instead.
    A read of the masks' last dim (P + S) has no input of its own: it must be the plain attention's
    (pruned), else _check_fused refuses the graph."""
    for n in g.g.node:
        if n.op_type == "Shape" and n.input[0] in MASKS and (g.attr(n, "start", 0), g.attr(n, "end")) in ((0, 1), (1, 2)):
            n.input[0] = "input_ids"


def _set_io(g: GraphIndex, layers: list[Layer], m: dict, kind: str) -> None:
    """The cache tensors become BNSH [batch, Hkv, cache, D]; seqlens_k and total_sequence_length
    come in; key_mask goes once nothing reads it (_prune)."""
    helper, TP = g.onnx.helper, g.onnx.TensorProto
    Hkv, D = m["n_kv_heads"], m["head_dim"]
    cache = {f"{p}.{L.i}.{w}" for L in layers for p in ("past", "present") for w in ("key", "value")}
    for vi in [*g.g.input, *g.g.output]:
        if vi.name in cache:
            elem = vi.type.tensor_type.elem_type
            vi.CopyFrom(helper.make_tensor_value_info(vi.name, elem, ["batch", Hkv, "cache", D]))
    g.g.input.extend([helper.make_tensor_value_info(SEQLENS, TP.INT32, ["batch"]),
                      helper.make_tensor_value_info(TOTAL, TP.INT32, [])]
                     + [helper.make_tensor_value_info(b, TP.FLOAT, ["bias_batch", 1, "sequence", "total"])
                        for b in (BIAS, BIAS_LOCAL) if b != BIAS_LOCAL or any(L.local for L in layers)])


def _emit_skip_norms(g: GraphIndex) -> int:
    """Every RMSNorm whose input is a residual Add (x + a, both activations) becomes one
    SkipSimplifiedLayerNormalization(x, a, weight) whose 4th output is the sum, which the Add's
    other readers take. The final norm reads a Gather of the sum (logits_index) and stays."""
    helper = g.onnx.helper
    count = 0
    for mul in list(g.g.node):
        if mul.op_type != "Mul" or not mul.output:
            continue
        found = _rmsnorm_input(g, mul.output[0])
        if found is None:
            continue
        x, w, eps = found
        add = g.op(x, "Add")
        if add is None or any(g.const(a) is not None for a in add.input):
            continue
        out, norm = mul.output[0], f"fused.skipnorm.{count}"
        g.g.node.append(helper.make_node("SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], w],
                                         [norm + ".out", "", "", norm + ".sum"], name=norm, domain=MS, epsilon=eps))
        inside = _norm_nodes(g, x, out)  # the plain norm's own ops read x; everyone else takes the sum
        for n in g.g.node:
            for k, v in enumerate(n.input):
                if v == out:
                    n.input[k] = norm + ".out"
                elif v == x and id(n) not in inside:
                    n.input[k] = norm + ".sum"
        for o in g.g.output:  # (a graph output would keep its name; none is expected here)
            if o.name in (x, out):
                raise NotFusable(f"{o.name}: a graph output inside a residual norm")
        g.reindex()
        count += 1
    g.toposort(NotFusable)
    return count


def _norm_nodes(g: GraphIndex, x: str, out: str) -> set[int]:
    """ids of the plain RMSNorm's nodes from x to out (the ancestors of out that read x's subtree)."""
    seen, stack = set(), [g.producer[out]]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        for v in n.input:
            p = g.producer.get(v)
            if v != x and p is not None and p.op_type != "Constant" and v not in g.inits:
                stack.append(p)
    return seen


def _prune(g: GraphIndex) -> None:
    """Drop every node, initializer and graph input the outputs no longer need."""
    g.toposort(NotFusable)
    need = prune_unneeded(g.g)
    if any(a.g.node for n in g.g.node for a in n.attribute):  # subgraphs (none expected) read outer names
        raise NotFusable("the graph has control flow")
    inputs = [i for i in g.g.input if i.name in need or i.name.startswith("past.")]
    del g.g.input[:]
    g.g.input.extend(inputs)
    g.reindex()
    forms = [v for v in g.g.value_info if v.name in need and g.is_const(v.name)]  # packed codes' types (nbits reads them)
    del g.g.value_info[:]
    g.g.value_info.extend(forms)
    g.reindex()


def _check_fused(g: GraphIndex, n_layers: int) -> None:
    """A silent half-rewrite must not pass: one GroupQueryAttention per layer, reading its own
    past.*, and nothing else reading the cache or a key mask."""
    gqa = [n for n in g.g.node if n.op_type == "GroupQueryAttention"]
    if len(gqa) != n_layers:
        raise NotFusable(f"{len(gqa)} GroupQueryAttention nodes for {n_layers} layers")
    for name, readers in g.consumers.items():
        if name.startswith("past.") and any(r.op_type != "GroupQueryAttention" for r in readers):
            raise NotFusable(f"{name} is still read by plain ops")
    for mask in MASKS:
        if mask in g.consumers:
            raise NotFusable(f"{mask} is still read")
