"""What the fused-attention pass recognises in a bundle's plain graph (docs/fused.md, "What is
matched"): per layer, the attention block's q|k|v projection, RoPE (or none), the static scales,
the output projection it feeds, and the RMSNorms around it. The names of the fused graph's own
inputs, and NotFusable, are here too: the pass (fused_attention.py) and the runtime both read them."""
from __future__ import annotations

import numpy as np

from edgekv.errors import BundleError
from edgekv.graph.index import GraphIndex

MS = "com.microsoft"
SEQLENS = "seqlens_k"
TOTAL = "total_sequence_length"
BIAS = "attention_bias"  # [1, 1, S, T] float: 0 where a token sees a key, -inf where not (the key mask)
# the sliding-window layers' own bias (Gemma 3): local_key_mask as 0 / -inf, the same shape. Not the
# op's local_window_size: that counts slots, and a pool's or a ring's cells are not in position order
BIAS_LOCAL = "attention_bias.local"
MASKS = ("key_mask", "local_key_mask")  # the plain graph's mask inputs, both replaced by the biases


class NotFusable(BundleError):
    """This bundle's graph has a layer the fused ops cannot express (the message says which)."""


class Layer:
    """What one layer's attention block was found to be in the plain graph, and how the op takes it."""

    def __init__(self, i: int, qkv: str, attn_out: str, k_scale, v_scale, rotary: str,
                 qk: str | None = None, v: str | None = None, tables: tuple | None = None,
                 scale: float | None = None, local: bool = False):
        self.i, self.qkv, self.attn_out = i, qkv, attn_out
        # the op's score scale where the graph multiplies the queries by a gain after RoPE (Gemma 3's
        # query_pre_attn_scalar): gain / sqrt(D); None: the op's own 1 / sqrt(D)
        self.scale = scale
        self.local = local  # a sliding-window layer: its keys through BIAS_LOCAL
        self.k_scale, self.v_scale = k_scale, v_scale  # [Hkv, D] constants (static int8), else None
        # "op": GroupQueryAttention rotates (tables: the graph's own cos/sin, by name); "graph":
        # the graph's RoPE stays, the op gets the rotated q|k (a rotation its kernel cannot do);
        # "none": a layer without RoPE (NoPE). Either way the op is fed qk [S, B, H+Hkv, D] with
        # v [S, B, Hkv, D], or, where qk is the projection's own q|k, the packed projection qkv.
        self.rotary, self.qk, self.v, self.tables = rotary, qk, v, tables


def _back_to_split(g: GraphIndex, name: str, scheme_kind: str):
    """Walk from present.{i}.* back to the Split output it was cut from. A float cache stores the
    Split's output as it is; a static int8 cache QuantizeLinear(Clip(Round(x / scale), -127, 127))
    with a constant scale (a float16 graph: Min(Max(...)) for the Clip, Cast to float32 after it).
    Returns (Split node, its output, the constant scale or None)."""
    scale = None
    if scheme_kind == "static":
        q = g.op(name, "QuantizeLinear")
        clamp = q and _clamp_of(g, _through_cast(g, q.input[0]))
        rnd = clamp and g.op(clamp[0], "Round")
        div = rnd and g.op(rnd.input[0], "Div")
        if div is None or g.const(q.input[1]) is None or float(g.const(q.input[1])) != 1.0:
            raise NotFusable(f"{name}: not written as QuantizeLinear(Clip(Round(x / scale)), 1.0)")
        lo, hi = clamp[1:]
        if lo is None or hi is None or float(lo) != -127.0 or float(hi) != 127.0:
            raise NotFusable(f"{name}: the cache's codes are not clamped to +-127")
        scale = g.const(div.input[1])
        if scale is None:  # a computed scale: the per-token scheme
            raise NotFusable(f"{name}: its scale is computed per token (GroupQueryAttention has no per-token mode)")
        name = div.input[0]
    split = g.op(name, "Split")
    if split is None:
        raise NotFusable(f"{name}: not cut from the projection by a Split")
    return split, name, scale


def _through_cast(g: GraphIndex, name: str) -> str:
    """The input of the Cast producing `name` (a float16 graph's casts around float32 math), else name."""
    n = g.op(name, "Cast")
    return n.input[0] if n is not None else name


def _clamp_of(g: GraphIndex, name: str):
    """name = Clip(x, lo, hi) or Min(Max(x, lo), hi) with constant bounds: (x, lo, hi), else None."""
    clip = g.op(name, "Clip")
    if clip is not None:
        return clip.input[0], g.const(clip.input[1]), g.const(clip.input[2])
    mn = g.op(name, "Min")
    mx = mn and g.op(mn.input[0], "Max")
    if mx is None:
        return None
    return mx.input[0], g.const(mx.input[1]), g.const(mn.input[1])


def _split_sizes(g: GraphIndex, split) -> list[int] | None:
    if len(split.input) > 1 and split.input[1]:
        v = g.const(split.input[1])
        return None if v is None else [int(x) for x in v]
    return None


def _match_layer(g: GraphIndex, i: int, m: dict, kind: str, dtype: str, positions: int) -> Layer:
    """Recognise layer i's attention block by its structure (docs/fused.md, "What is matched"):
    present.{i}.key <- Split[H, Hkv] of the cached q|k; present.{i}.value <- Split[H+Hkv, Hkv] of
    Transpose(Reshape(qkv)), whose q|k part reaches the cached q|k through the layer's own ops
    (a per-head q/k norm, RoPE, nothing: _match_rope says which); the attention's output is what
    the output projection (a [H*D, E] weight) multiplies, found back from the residual Add."""
    H, Hkv, D, E = m["n_heads"], m["n_kv_heads"], m["head_dim"], m["hidden_size"]
    if D % GQA_HEAD_ALIGN:
        raise NotFusable(f"layer {i}: head_dim {D} (GroupQueryAttention's CPU kernel takes multiples of {GQA_HEAD_ALIGN})")
    ksplit, kname, ks = _back_to_split(g, f"present.{i}.key", kind)
    vsplit, vname, vs = _back_to_split(g, f"present.{i}.value", kind)
    if _split_sizes(g, ksplit) != [H, Hkv] or list(ksplit.output).index(kname) != 1:
        raise NotFusable(f"layer {i}: the keys are not the last {Hkv} heads of the RoPE'd q|k")
    if _split_sizes(g, vsplit) != [H + Hkv, Hkv] or list(vsplit.output).index(vname) != 1:
        raise NotFusable(f"layer {i}: the values are not the last {Hkv} heads of q|k|v")
    scale = _query_scale(g, i, ksplit.output[0], D)
    rotary, qk, tables = _match_rope(g, i, ksplit.input[0], D, positions)
    tr = g.op(vsplit.input[0], "Transpose")
    if tr is None or list(g.attr(tr, "perm", [])) != [1, 0, 2, 3]:
        raise NotFusable(f"layer {i}: q|k|v is not made slot-major by Transpose [1, 0, 2, 3]")
    rs = g.op(tr.input[0], "Reshape")
    if rs is None:
        raise NotFusable(f"layer {i}: q|k|v is not a Reshape of the projection")
    qkv = rs.input[0]
    h = _activation_of(g, qkv, [E, (H + 2 * Hkv) * D])
    if h is None:
        raise NotFusable(f"layer {i}: no q|k|v projection of width {(H + 2 * Hkv) * D} found")
    attn_out = _attention_output(g, i, h, [H * D, E], dtype)
    for s in (ks, vs):
        if s is not None and s.shape != (Hkv, D):
            raise NotFusable(f"layer {i}: static scale of shape {s.shape}, expected {(Hkv, D)}")
    if qk == vsplit.output[0]:  # the projection's own q|k: its packed output is the op's input as it is
        qk = None
    return Layer(i, qkv, attn_out, ks, vs, rotary, qk, vsplit.output[1], tables, scale, i in m.get("local_layers", ()))


def _query_scale(g: GraphIndex, i: int, q: str, D: int) -> float | None:
    """The queries q [S, B, H, D] go to attention as they are (None: the op's 1 / sqrt(D)) or
    through one Mul by a constant scalar gain (Gemma 3's query_pre_attn_scalar, export/model.py's
    q_gain): the op's `scale` is then gain / sqrt(D). Anything else is refused."""
    readers = g.consumers.get(q, [])
    if all(c.op_type == "Reshape" for c in readers):
        return None
    mul = readers[0] if len(readers) == 1 and readers[0].op_type == "Mul" else None
    gain = mul and next((g.const(x) for x in mul.input if x != q), None)
    if (gain is None or gain.size != 1 or q not in mul.input
            or any(c.op_type != "Reshape" for c in g.consumers.get(mul.output[0], []))):
        raise NotFusable(f"layer {i}: the queries are changed after RoPE other than by a constant gain")
    return float(gain.reshape(())) / float(np.sqrt(D))


# the graph dtypes the rewrite takes -> the op's T (onnx.TensorProto's FLOAT, FLOAT16); k/v scales stay float
FLOAT_TYPES = {"float32": 1, "float16": 10}

# GroupQueryAttention's CPU kernel (onnxruntime 1.32, probed): head_size a multiple of 8, and to
# rotate inside the op a multiple of 16 with a cos/sin width (rotary dims / 2) a multiple of 8
GQA_HEAD_ALIGN = 8
GQA_ROTARY_ALIGN = 16


def _match_rope(g: GraphIndex, i: int, rope_out: str, D: int, positions: int):
    """How the cached q|k rope_out comes from the layer's q|k: (rotary, the q|k the op is fed,
    the cos/sin tables the op rotates with or None). RoPE is qk * cos + (qk @ R) * sin with R
    rotate_half's matrix on the first r dims (export/model.py; partial rotary: r < D), cos/sin
    functions of position_ids alone (llama3 scaling, LongRoPE's factors and attention factor are
    the graph's own constants in them): the op rotates when its kernel can (tables evaluated
    from the graph), else the graph's RoPE stays before it. No Add there: no RoPE (NoPE)."""
    add = g.op(rope_out, "Add")
    if add is None:
        return "none", rope_out, None
    muls = [g.op(x, "Mul") for x in add.input]
    mat = None
    if len(muls) == 2 and None not in muls:
        mat = next((g.op(x, "MatMul") for mm in muls for x in mm.input if g.op(x, "MatMul")), None)
    qk = mat.input[0] if mat is not None else None
    plain = next((mm for mm in muls if mm is not None and qk in mm.input), None) if qk else None
    rot = next((mm for mm in muls if mm is not plain), None) if plain else None
    if plain is None or rot is None or mat.output[0] not in rot.input:
        raise NotFusable(f"layer {i}: RoPE is not qk * cos + (qk @ R) * sin")
    r = _rotary_dims(g.const(mat.input[1]), D)
    if r is None:
        raise NotFusable(f"layer {i}: RoPE's rotation is not rotate_half (interleaved, or not the exporter's)")
    cos = next(x for x in plain.input if x != qk)
    sin = next(x for x in rot.input if x != mat.output[0])
    for t in (cos, sin):
        if _graph_inputs_of(g, t) != {"position_ids"}:
            raise NotFusable(f"layer {i}: RoPE's tables are not functions of position_ids alone")
    if D % GQA_ROTARY_ALIGN or r % GQA_ROTARY_ALIGN:
        return "graph", rope_out, None
    c, s = _eval_tables(g, cos, sin, positions, D)
    h = r // 2
    if not (np.array_equal(c[:, :h], c[:, h:r]) and np.array_equal(s[:, :h], s[:, h:r]) and np.all(c[:, r:] == 1.0)):
        return "graph", rope_out, None  # not rotate_half's tables: the graph's own RoPE stays exact
    return "op", qk, (cos, sin, c[:, :h], s[:, :h])


def rotate_half_matrix(d: int, rotary: int | None = None) -> np.ndarray:
    """The exporter's rotate_half matrix (export/model.py): x @ R = cat(-x[r/2:r], x[:r/2], 0...)."""
    h = (rotary or d) // 2
    r = np.zeros((d, d), np.float32)
    r[np.arange(h) + h, np.arange(h)] = -1.0
    r[np.arange(h), np.arange(h) + h] = 1.0
    return r


def _rotary_dims(r: np.ndarray | None, d: int) -> int | None:
    """The r for which r_matrix is rotate_half_matrix(d, r), else None."""
    if r is None or r.shape != (d, d):
        return None
    n = 2 * int((r == 1.0).sum())
    return n if 0 < n <= d and np.array_equal(r, rotate_half_matrix(d, n)) else None


def _graph_inputs_of(g: GraphIndex, name: str) -> set[str]:
    """The graph inputs `name` is computed from (constants are not inputs)."""
    inputs = {i.name for i in g.g.input}
    seen, stack, found = set(), [name], set()
    while stack:
        x = stack.pop()
        if x in seen or not x:
            continue
        seen.add(x)
        if x in inputs:
            found.add(x)
        n = g.producer.get(x)
        if n is not None:
            stack.extend(n.input)
    return found


def _eval_tables(g: GraphIndex, cos: str, sin: str, positions: int, D: int):
    """cos and sin [positions, D] as the graph computes them for positions 0.. positions - 1 (the
    graph's own ops and constants, run by onnxruntime as the plain graph runs them)."""
    key, tables = (cos, sin, positions), g.memo.setdefault("rope_tables", {})
    if key not in tables:
        onnx, helper = g.onnx, g.onnx.helper
        nodes, consts, need = [], [], {cos, sin}
        for n in reversed(list(g.g.node)):
            if any(o in need for o in n.output):
                nodes.append(n)
                need.update(x for x in n.input if x)
        for x in sorted(need):
            if x in g.inits:
                consts.append(g.nh.from_array(g.const(x), x))
        graph = helper.make_graph(nodes[::-1], "rope_tables",
                                  [helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, [1, positions])],
                                  [helper.make_empty_tensor_value_info(t) for t in (cos, sin)],
                                  consts)
        model = helper.make_model(graph, opset_imports=list(g.model.opset_import), ir_version=g.model.ir_version)
        import onnxruntime

        sess = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        out = sess.run(None, {"position_ids": np.arange(positions, dtype=np.int64)[None]})
        for t in out:
            if t.size != positions * D or t.shape[-1] != D:
                raise NotFusable(f"RoPE's tables have shape {t.shape}, not one row of {D} per position")
        tables[key] = tuple(t.reshape(positions, D) for t in out)
    return tables[key]


def _weight_matmul_input(g: GraphIndex, out: str, dims: list[int], depth: int = 6) -> str | None:
    """The activation a [K, N] weight multiplies on the way to `out`: walks back through Add
    (bias, GGUF Q4_1's minimum term) to the MatMul whose B is a weight of `dims`."""
    n = g.producer.get(out)
    if n is None or depth == 0:
        return None
    if n.op_type == "MatMul" and g.const_dims(n.input[1]) == dims:
        return n.input[0]
    if n.op_type == "Add":
        for x in n.input:
            a = _weight_matmul_input(g, x, dims, depth - 1)
            if a is not None:
                return a
    return None


def _activation_of(g: GraphIndex, qkv: str, dims: list[int]) -> str | None:
    return _weight_matmul_input(g, qkv, dims)


def _attention_output(g: GraphIndex, i: int, h: str, wo_dims: list[int], dtype: str) -> str:
    """h = RMSNorm(x) is what the q|k|v projection multiplies; x's consumer Add is the residual
    x + wo(attention); the tensor the [H*D, E] weight there multiplies is the attention's output.
    The norm's weight is in the graph's float type, which must be the manifest's (the op's T)."""
    norm_in = _rmsnorm_input(g, h)
    if norm_in is None:
        raise NotFusable(f"layer {i}: the q|k|v projection's input is not an RMSNorm")
    x, w, _ = norm_in
    if g.const(w).dtype != np.dtype(dtype):
        raise NotFusable(f"layer {i}: the graph computes in {g.const(w).dtype}, its manifest says {dtype}")
    for add in g.consumers.get(x, []):
        if add.op_type != "Add":
            continue
        other = add.input[1] if add.input[0] == x else add.input[0]
        post = _rmsnorm_input(g, other)  # Gemma 3's post-attention norm: x + norm(wo(attention))
        a = _weight_matmul_input(g, other if post is None else post[0], wo_dims)
        if a is not None:
            return a
    raise NotFusable(f"layer {i}: no residual Add of an output projection found")


def _rmsnorm_input(g: GraphIndex, h: str):
    """h = weight * (x / Sqrt(ReduceMean(x^2) + eps)) (export/model.py's RMSNorm; a float16
    graph: x cast to float32 first, the quotient cast back): (x, weight name, eps), else None."""
    mul = g.op(h, "Mul")
    if mul is None:
        return None
    for w, d in (mul.input, mul.input[::-1]):
        div = g.op(_through_cast(g, d), "Div")
        if div is None or g.const(w) is None:
            continue
        x = div.input[0]
        sq = g.op(div.input[1], "Sqrt")
        add = sq and g.op(sq.input[0], "Add")
        if add is None:
            continue
        for mean_name, eps_name in (add.input, add.input[::-1]):
            mean = g.op(mean_name, "ReduceMean")
            eps = g.const(eps_name)
            pw = mean and g.op(mean.input[0], "Pow")
            if pw is not None and eps is not None and pw.input[0] == x and float(g.const(pw.input[1])) == 2.0:
                return _through_cast(g, x), w, float(eps)
    return None
