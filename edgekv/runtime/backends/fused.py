"""A bundle's plain graph rewritten at load into onnxruntime's fused ops (docs/fused.md).

The bundle stays as it is (standard ONNX, TensorRT-parsable). At load this module derives a second
graph from it for onnxruntime's CPU provider:

- per layer, one com.microsoft GroupQueryAttention in place of the plain attention block (RoPE,
  quantize of the new K/V, the two attention products, softmax, the mask), fed the layer's own
  packed q|k|v projection and writing the layer's cache;
- the residual Add before an RMSNorm folded with it into SkipSimplifiedLayerNormalization.

Everything else (embedding, projections, MLP, head, their quantized weights) is the bundle's own
graph, its weights read from the bundle's data file: nothing is stored twice. What is new is tiny
and derived: the RoPE cos/sin tables (from the graph's own inv_freq constant) and, for a static
int8 cache, the layer's calibrated scales in GroupQueryAttention's PER_CHANNEL shape [1, Hkv, 1, D].

The fused graph's I/O differs from the plain contract (docs/graph.md) in the cache and the mask:

  inputs   input_ids, position_ids, logits_index (as before), seqlens_k int32 [B] (tokens in
           the cache after this call, minus 1), total_sequence_length int32 [] (their maximum),
           attention_bias float [1, 1, S, T] (T = total_sequence_length: the key mask as 0 / -inf),
           attention_bias.local (models with sliding-window layers: their local_key_mask as 0 / -inf),
           past.{i}.key / .value [B, Hkv, C, D] (BNSH, the whole buffer of capacity C)
  outputs  logits; present.{i}.key / .value [B, Hkv, C, D]: the same buffer (bound at the same
           address as past: GroupQueryAttention writes the new tokens in place)

No key_mask: GroupQueryAttention's causal rule over each entry's first seqlens_k + 1 slots is the
linear cache's mask, and attention_bias [1, 1, S, T] (0 / -inf) carries any other (a ring's
overwritten slots, the serving pool's other sequences; OrtBackend._run_fused). The per-token int8
scheme cannot be expressed (the op has no per-token scales), nor int4's levels and rotation: those
bundles raise NotFusable, and the caller keeps the plain graph.

Needs the `onnx` package (a runtime dependency already, for cast_cache_reads in ort.py).
"""
from __future__ import annotations

import numpy as np

from edgekv.errors import BundleError
from edgekv.format.bundle import Bundle
from edgekv.format.weight_forms import cone, evaluate
from edgekv.runtime.backends.versions import dotted, ort_version

# GroupQueryAttention's CPU kernel takes an int8 cache from onnxruntime 1.27 (docs/fused.md). Older
# releases (1.23.2: the newest wheel for CPython 3.10 on aarch64, JetPack 6's Python) run the
# bundle's graph as written; pyproject's floor is the plain graph's (versions.py, tests/test_ort_versions.py)
MIN_ORT = (1, 27)
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


def ort_version_ok(version: str) -> bool:
    """onnxruntime `version` has GroupQueryAttention's int8-cache CPU kernel."""
    return ort_version(version) >= MIN_ORT


def ort_refusal(version: str) -> str | None:
    """Why onnxruntime `version` cannot run the fused graph (None: it can): the reason in the load
    log's line, "attention: the bundle's graph as written (...)"."""
    if ort_version_ok(version):
        return None
    return (f"onnxruntime {version} has no int8-cache GroupQueryAttention on CPU "
            f"(the fused path needs {dotted(MIN_ORT)}+)")


class _Graph:
    """The plain graph with the look-ups the matcher needs: producers, consumers, constants."""

    def __init__(self, model, base_dir: str):
        import onnx
        from onnx import numpy_helper

        self.onnx, self.nh = onnx, numpy_helper
        self.model, self.g, self.base_dir = model, model.graph, base_dir
        self.inits = {t.name: t for t in self.g.initializer}
        self.infos = {v.name: v for v in self.g.value_info}
        self.tables: dict[tuple, tuple] = {}  # (cos, sin, positions) -> the graph's RoPE tables, evaluated
        self.reindex()

    def reindex(self) -> None:
        self.producer = {o: n for n in self.g.node for o in n.output if o}
        self.consumers: dict[str, list] = {}
        for n in self.g.node:
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)

    def const(self, name: str) -> np.ndarray | None:
        """The value of a constant tensor (initializer, Constant node, or a weight form: an fp16
        block scale's Cast to float32, packed codes; edgekv/format/weight_forms.py), else None."""
        t = self.inits.get(name)
        if t is not None:
            if t.data_location == self.onnx.TensorProto.EXTERNAL:
                return self.nh.to_array(t, self.base_dir)
            return self.nh.to_array(t)
        n = self.producer.get(name)
        if n is not None and n.op_type == "Constant":
            return self.nh.to_array(n.attribute[0].t) if n.attribute[0].name == "value" else None
        nodes = cone(name, self.producer, self.inits)
        return evaluate(name, nodes, self.inits, self.base_dir) if nodes else None

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


def _back_to_split(g: _Graph, name: str, scheme_kind: str):
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


def _through_cast(g: _Graph, name: str) -> str:
    """The input of the Cast producing `name` (a float16 graph's casts around float32 math), else name."""
    n = g.op(name, "Cast")
    return n.input[0] if n is not None else name


def _clamp_of(g: _Graph, name: str):
    """name = Clip(x, lo, hi) or Min(Max(x, lo), hi) with constant bounds: (x, lo, hi), else None."""
    clip = g.op(name, "Clip")
    if clip is not None:
        return clip.input[0], g.const(clip.input[1]), g.const(clip.input[2])
    mn = g.op(name, "Min")
    mx = mn and g.op(mn.input[0], "Max")
    if mx is None:
        return None
    return mx.input[0], g.const(mx.input[1]), g.const(mn.input[1])


def _split_sizes(g: _Graph, split) -> list[int] | None:
    if len(split.input) > 1 and split.input[1]:
        v = g.const(split.input[1])
        return None if v is None else [int(x) for x in v]
    return None


def _match_layer(g: _Graph, i: int, m: dict, kind: str, dtype: str, positions: int) -> Layer:
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


def _query_scale(g: _Graph, i: int, q: str, D: int) -> float | None:
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


def _match_rope(g: _Graph, i: int, rope_out: str, D: int, positions: int):
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


def _graph_inputs_of(g: _Graph, name: str) -> set[str]:
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


def _eval_tables(g: _Graph, cos: str, sin: str, positions: int, D: int):
    """cos and sin [positions, D] as the graph computes them for positions 0.. positions - 1 (the
    graph's own ops and constants, run by onnxruntime as the plain graph runs them)."""
    key = (cos, sin, positions)
    if key not in g.tables:
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
        g.tables[key] = tuple(t.reshape(positions, D) for t in out)
    return g.tables[key]


def _weight_matmul_input(g: _Graph, out: str, dims: list[int], depth: int = 6) -> str | None:
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


def _activation_of(g: _Graph, qkv: str, dims: list[int]) -> str | None:
    return _weight_matmul_input(g, qkv, dims)


def _attention_output(g: _Graph, i: int, h: str, wo_dims: list[int], dtype: str) -> str:
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


def _rmsnorm_input(g: _Graph, h: str):
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


class FusedGraph:
    """The rewritten model and what the rewrite did."""

    def __init__(self, model, layers: list[Layer], skip_norms: int, kind: str):
        self.model = model
        self.layers = layers
        self.skip_norms = skip_norms
        self.kind = kind  # "float" | "static": the cache the fused graph reads and writes

    def serialize(self) -> bytes:
        return self.model.SerializeToString()


def fuse_bundle(bundle: Bundle, max_positions: int | None = None, skip_norm: bool = True) -> FusedGraph:
    """Derive the fused graph from `bundle`'s plain graph (its weights stay in the bundle's data
    file). max_positions: rows of the RoPE tables (default: the bundle's verified context)."""
    import onnx

    kind = bundle.scheme.kind
    if kind not in ("float", "static"):
        raise NotFusable(f"{bundle.path}: the {bundle.manifest['kv']['scheme']} KV scheme has no GroupQueryAttention "
                         f"form (the op's int8 cache takes only constant per-tensor or per-channel scales)")
    if bundle.dtype not in FLOAT_TYPES:  # the op's T: its activations, RoPE tables and bias
        raise NotFusable(f"{bundle.path}: a {bundle.dtype} graph (the fused rewrite handles {', '.join(FLOAT_TYPES)})")
    model = onnx.load(str(bundle.onnx_path), load_external_data=False)
    g = _Graph(model, str(bundle.onnx_path.parent))
    m = bundle.model
    positions = max_positions or bundle.max_context
    layers = [_match_layer(g, i, m, kind, bundle.dtype, positions) for i in range(m["n_layers"])]
    _emit_attention(g, layers, m, kind, bundle.dtype)
    skips = _emit_skip_norms(g) if skip_norm else 0
    _prune(g)
    _check_fused(g, m["n_layers"])
    return FusedGraph(model, layers, skips, kind)


def _emit_attention(g: _Graph, layers: list[Layer], m: dict, kind: str, dtype: str) -> None:
    onnx, helper, nh = g.onnx, g.onnx.helper, g.nh
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
            _rename(g, old, old + ".plain")
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


def _bias_as(g: _Graph, bias: str, dtype: str) -> str:
    """A bias input in the op's T: the graph input stays float32 (what the runtime feeds for every
    bundle); a float16 graph casts it once (0 and -inf are exact in float16)."""
    if dtype == "float32":
        return bias
    name = f"{bias}.{dtype}"
    g.g.node.append(g.onnx.helper.make_node("Cast", [bias], [name], name=name, to=FLOAT_TYPES[dtype]))
    return name


def _pack_qkv(g: _Graph, nodes: list, i: int, qk: str, v: str) -> str:
    """The op's packed query [B, S, (H+2Hkv)*D] from the layer's q|k [S, B, H+Hkv, D] (after its
    norm, or its RoPE where the graph keeps that) and v [S, B, Hkv, D]."""
    helper, p = g.onnx.helper, f"fused.{i}.qkv"
    g.g.initializer.append(g.nh.from_array(np.array([0, 0, -1], np.int64), p + ".shape"))
    nodes += [helper.make_node("Concat", [qk, v], [p + ".sb"], name=p + ".concat", axis=2),  # [S, B, H+2Hkv, D]
              helper.make_node("Transpose", [p + ".sb"], [p + ".bs"], name=p + ".transpose", perm=[1, 0, 2, 3]),
              helper.make_node("Reshape", [p + ".bs", p + ".shape"], [p], name=p + ".reshape")]
    return p


def _batch_from_positions(g: _Graph) -> None:
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


def _sizes_from_ids(g: _Graph) -> None:
    """The graph as exported may read the call's sizes off a mask (Gemma 3's: Shape(local_key_mask)[1:2],
    the new tokens S); the fused graph has no mask input, so those read input_ids' [B, S] instead.
    A read of the masks' last dim (P + S) has no input of its own: it must be the plain attention's
    (pruned), else _check_fused refuses the graph."""
    for n in g.g.node:
        if n.op_type == "Shape" and n.input[0] in MASKS and (g.attr(n, "start", 0), g.attr(n, "end")) in ((0, 1), (1, 2)):
            n.input[0] = "input_ids"


def _rename(g: _Graph, old: str, new: str) -> None:
    for n in g.g.node:
        for k, x in enumerate(n.input):
            if x == old:
                n.input[k] = new
        for k, x in enumerate(n.output):
            if x == old:
                n.output[k] = new


def _set_io(g: _Graph, layers: list[Layer], m: dict, kind: str) -> None:
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


def _emit_skip_norms(g: _Graph) -> int:
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
    _toposort(g)
    return count


def _norm_nodes(g: _Graph, x: str, out: str) -> set[int]:
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


def _toposort(g: _Graph) -> None:
    """Order the nodes so every input is produced before it is read (new nodes were appended)."""
    have = {i.name for i in g.g.input} | {t.name for t in g.g.initializer} | {""}
    nodes, out = list(g.g.node), []
    pending = nodes
    while pending:
        rest = []
        for n in pending:
            if all(x in have for x in n.input):
                out.append(n)
                have.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise NotFusable("the rewritten graph has a cycle or an input nobody produces: "
                             + ", ".join(x for n in rest[:3] for x in n.input if x not in have))
        pending = rest
    del g.g.node[:]
    g.g.node.extend(out)
    g.reindex()


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


def _prune(g: _Graph) -> None:
    """Drop every node, initializer and graph input the outputs no longer need."""
    _toposort(g)
    need = prune_unneeded(g.g)
    if any(a.g.node for n in g.g.node for a in n.attribute):  # subgraphs (none expected) read outer names
        raise NotFusable("the graph has control flow")
    inputs = [i for i in g.g.input if i.name in need or i.name.startswith("past.")]
    del g.g.input[:]
    g.g.input.extend(inputs)
    g.inits = {t.name: t for t in g.g.initializer}
    g.reindex()
    forms = [v for v in g.g.value_info if v.name in need and g.is_const(v.name)]  # packed codes' types (nbits reads them)
    del g.g.value_info[:]
    g.g.value_info.extend(forms)
    g.infos = {v.name: v for v in forms}


def _check_fused(g: _Graph, n_layers: int) -> None:
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
