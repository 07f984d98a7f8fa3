"""A GGUF minimum folded into MatMulNBits' zero points at load (edgekv/runtime/backends/nbits.py,
docs/weights.md). Oracles: the exact float64 product with the block values W = s*(c + shift) + m;
a numpy model of MatMulNBits' int8 activations (per block of 32, absmax / 127, round half to even)
applied as llama.cpp's Q4_1 x Q8_1 dot applies them, to the codes and the minimum alike; the graph
as the exporter writes it (export.weights_graph._quantized_matmul) run by onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgekv.graph.passes.minimum_fold import FoldReport, fold_minimums, fold_weights
from edgekv.graph.index import cone
from export.weights import QuantWeight
from export.weights_graph import Emitted, _quantized_matmul

B = 32


def q41_like(n: int, k: int, rng, bits: int = 4) -> QuantWeight:
    """Blocks W = s*(c + shift) + m as the exporter holds Q4_1 (4 bits, c = q - 8, shift 8) or Q5_1
    (8 bits, c = q in 0..31), quantized as llama.cpp does from weights centred on 0 with heavy tails
    (m = the block's min, s = its range / levels, fp16), so a block's midpoint is off 0 as on the
    real model; and a few odd blocks: s == 0 (the block is m), m > 0 (not spanning 0), m far below
    (the zero point clipped)."""
    nb, top = k // B, (15 if bits == 4 else 31)
    w = rng.standard_t(3, (n, nb, B)) * 0.02
    m = w.min(-1).astype(np.float16).astype(np.float32)
    s = ((w.max(-1) - m) / top).astype(np.float16).astype(np.float32)
    s[0, :3] = 0.0  # s == 0: the whole block is m
    m[1, 0] = np.float16(0.01)  # above 0
    m[2, 0] = np.float16(-s[2, 0] * 300)  # far below: z clipped
    q = np.clip(np.rint((w - m[..., None]) / np.where(s > 0, s, 1)[..., None]), 0, top).reshape(n, k)
    shift = 8 if bits == 4 else 0
    return QuantWeight(bits, (q - shift).astype(np.int8), s, B, "test", m, shift, "Q4_1" if bits == 4 else "Q5_1")


def exact_w(q: QuantWeight) -> np.ndarray:
    """W [N, K] in float64, every term exact."""
    n, k = q.codes.shape
    w = (q.codes.astype(np.float64) + q.shift).reshape(n, k // B, B) * q.scales.astype(np.float64)[..., None]
    return (w + q.mins.astype(np.float64)[..., None]).reshape(n, k)


def matrix_graph(q: QuantWeight) -> onnx.ModelProto:
    """One projection y = x W^T written as the exporter writes it (DQ -> MatMul + minimum term)."""
    n, k = q.codes.shape
    inits = Emitted()  # Q5_1's codes packed at 5 bits: their value_info is how the fold reads their type
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    nodes = _quantized_matmul(node, "layers.0.mlp.up.weight", q, np.float32, inits)
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "s", n])], inits,
                          value_info=inits.value_info)
    return as_loaded(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]))


def as_loaded(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph as the runtime hands it to the fold: as exported (fp16 scales and minimums, where
    the values are fp16, behind their Casts X_f16 -> Cast, which the fold reads as constants)."""
    return model


def session(model: onnx.ModelProto, accuracy: int, report: FoldReport | None = None, **options):
    o = ort.SessionOptions()
    o.intra_op_num_threads = 1
    o.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy))
    for k, v in options.items():
        setattr(o, k, v)
    handed = report.hand_to(ort, o) if report else []
    return ort.InferenceSession(model.SerializeToString(), o, providers=["CPUExecutionProvider"]), handed


def run(model: onnx.ModelProto, x: np.ndarray, accuracy: int, report: FoldReport | None = None) -> np.ndarray:
    s, _ = session(model, accuracy, report)
    return s.run(None, {"x": x})[0].astype(np.float64)


def folded(q: QuantWeight, accuracy: int) -> tuple[onnx.ModelProto, FoldReport]:
    m = matrix_graph(q)
    return m, fold_minimums(m, ".")


def int8_activations(x: np.ndarray) -> np.ndarray:
    """MatMulNBits' int8 activations (and llama.cpp's Q8): per block of 32 along K, scale absmax / 127,
    codes rounded half to even; the values they stand for."""
    xb = x.astype(np.float32).reshape(*x.shape[:-1], -1, B)
    scale = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    codes = np.rint(np.where(scale > 0, xb / np.where(scale > 0, scale, 1), 0))
    return (codes * scale).astype(np.float64).reshape(x.shape)


def activations(rng, k: int, rows: int = 3) -> np.ndarray:
    x = rng.standard_normal((1, rows, k)) * (1 + 6 * (rng.random(k) < 0.03))  # a few large channels
    return x.astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
def test_fold_weights_are_the_blocks_exactly(bits):
    """s*(u - z) + r is the block's value exactly (float64, every term exact), z an integer in the
    codes' range, |r| <= |s|/2 wherever the block spans 0, r = m where s == 0."""
    q = q41_like(24, 128, np.random.default_rng(1), bits)
    zp, r = fold_weights(q.scales.T, q.mins.T, float(q.shift), bits)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    assert zp.dtype == np.int8 and lo <= zp.min() and zp.max() <= hi
    s64 = np.repeat(q.scales.astype(np.float64), B, axis=1)
    w = s64 * (q.codes.astype(np.float64) - np.repeat(zp.T, B, axis=1)) + np.repeat(r.T.astype(np.float64), B, axis=1)
    np.testing.assert_array_equal(w, exact_w(q))
    # blocks whose zero lies inside the codes' range: the remainder is at most half a step
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = -(q.mins / q.scales) - q.shift  # where W = 0, in codes
    inside = (q.scales > 0) & (zero >= lo) & (zero <= hi)
    assert inside.mean() > 0.9 and np.all(np.abs(r.T[inside]) <= q.scales[inside] / 2)
    np.testing.assert_array_equal(r.T[0, :3], q.mins[0, :3] + 0.0)  # s == 0: the block is m, zp 0
    np.testing.assert_array_equal(zp.T[0, :3], 0)


def test_a_remainder_that_is_not_a_float32_keeps_the_term():
    """m + s*z not representable in float32: fold_weights refuses, the graph keeps that matrix as
    written, and the result is still the exact product."""
    q = q41_like(8, 64, np.random.default_rng(2))
    q.scales[3, 1] = np.float32(1 + 2 ** -23)
    q.mins[3, 1] = np.float32(-3 * 2 ** 20)
    assert fold_weights(q.scales.T, q.mins.T, 8.0, 4) is None
    m, report = folded(q, 0)
    assert report.folded == 0 and list(report.kept.values()) == ["a remainder m + s*z that is not a float32"]
    assert not any(len(n.input) > 2 for n in m.graph.node if n.op_type == "DequantizeLinear")


def optimized(model: onnx.ModelProto, report: FoldReport, tmp_path) -> onnx.GraphProto:
    """The graph onnxruntime runs for `model` (its optimizer's output)."""
    session(model, 4, report, optimized_model_filepath=str(tmp_path / "opt.onnx"))
    return onnx.load(str(tmp_path / "opt.onnx"), load_external_data=False).graph


def indicator(k: int) -> np.ndarray:
    """[K, K/B]: 1 where row k lies in block j; x @ it is x's block sums (the oracle's own construction)."""
    return np.kron(np.eye(k // B, dtype=np.float32), np.ones((B, 1), np.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_folded_matrix_is_one_matmulnbits_with_zero_points(bits, tmp_path):
    """The folded graph: the DequantizeLinear has integer zero points (the codes' type), the minimum
    term is the remainder's MatMul over x's blocksums (K/B rows, not the old 2K/B), those one MatMul
    of x by the 0/1 block indicator in place of Reshape + ReduceSum, no Concat or Mul; onnxruntime
    runs it as one MatMulNBits with uint8 zero points (a silent fallback, the DQ left unfused or the
    old term kept, fails here)."""
    q = q41_like(48, 128, np.random.default_rng(3), bits)
    m, report = folded(q, 4)
    assert report.folded == 1 and not report.kept
    dq = next(n for n in m.graph.node if n.op_type == "DequantizeLinear")
    made, names = {o: n for n in m.graph.node for o in n.output}, {t.name for t in m.graph.initializer}
    form = {id(n) for n in cone(dq.input[0], made, names)}  # Q5_1's codes unpacked (weight_forms), as written
    rest = [n for n in m.graph.node if id(n) not in form]
    assert bool(form) == (bits == 8)
    casts = [n for n in rest if n.op_type == "Cast"]  # only the scale's fp16 -> float32 (the minimum's went with its term)
    assert len(casts) <= 1 and all(c.output[0] == dq.input[1] for c in casts)
    ops = sorted(n.op_type for n in rest if n.op_type != "Cast")
    assert ops == ["Add", "DequantizeLinear", "MatMul", "MatMul", "MatMul"]
    inits = {t.name: t for t in m.graph.initializer}
    assert inits[dq.input[2]].data_type == (TensorProto.INT4 if bits == 4 else TensorProto.INT8)
    blocksum = next(n for n in m.graph.node if n.op_type == "MatMul" and n.input[0] == "x" and n.input[1] in inits)
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(inits[blocksum.input[1]]), indicator(128))
    g = optimized(m, report, tmp_path)
    assert sorted(n.op_type for n in g.node) == ["Add", "MatMul", "MatMul", "MatMulNBits"]
    inits = {t.name: t for t in g.initializer}
    nb = next(n for n in g.node if n.op_type == "MatMulNBits")
    assert len(nb.input) > 3 and inits[nb.input[3]].data_type == TensorProto.UINT8
    assert {a.name: helper.get_attribute_value(a) for a in nb.attribute}["bits"] == bits
    sums = {n.output[0] for n in g.node if n.op_type == "MatMul" and n.input[0] == "x"}
    term = next(n for n in g.node if n.op_type == "MatMul" and n.input[0] in sums)
    assert list(inits[term.input[1]].dims) == [128 // B, 48]


def sorted_topologically(g: onnx.GraphProto) -> bool:
    """Every node reads only graph inputs, initializers and outputs of nodes before it."""
    known = {v.name for v in g.input} | {t.name for t in g.initializer} | {""}
    for n in g.node:
        if not set(n.input) <= known:
            return False
        known |= set(n.output)
    return True


def test_matrices_share_their_input_blocksum(tmp_path):
    """Two matrices reading x (K = 128, made by a node, as a norm's output is) and one reading x2
    (K = 64, a graph input): one blocksum MatMul per input, after what makes it (the graph still
    sorted), one indicator constant per K, the bundle's three Reshape + ReduceSum gone; at float
    activations each output is its exact product."""
    rng = np.random.default_rng(7)
    qs = {"y1": (q41_like(48, 128, rng), "x"), "y2": (q41_like(24, 128, rng), "x"), "y3": (q41_like(16, 64, rng), "x2")}
    inits, nodes = [], [helper.make_node("Identity", ["x_in"], ["x"], name="norm")]
    for y, (q, x) in qs.items():
        nodes += _quantized_matmul(helper.make_node("MatMul", [x, "w"], [y], name=y), f"layers.0.{y}.weight", q,
                                   np.float32, inits)
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, "s", k])
                                       for x, k in (("x_in", 128), ("x2", 64))],
                          [helper.make_tensor_value_info(y, TensorProto.FLOAT, [1, "s", q.codes.shape[0]])
                           for y, (q, _) in qs.items()], inits)
    m = as_loaded(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]))
    assert sum(n.op_type == "ReduceSum" for n in m.graph.node) == 3
    report = fold_minimums(m, ".")
    assert report.folded == 3 and not report.kept and not any(n.op_type in ("ReduceSum", "Reshape") for n in m.graph.node)
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer
              if t.data_location != TensorProto.EXTERNAL}  # the remainders come with the session options
    sums = [n for n in m.graph.node if n.op_type == "MatMul" and n.input[0] in ("x", "x2") and n.input[1] in consts]
    assert sorted(n.input[0] for n in sums) == ["x", "x2"] and sorted_topologically(m.graph)
    for n in sums:
        np.testing.assert_array_equal(consts[n.input[1]], indicator(128 if n.input[0] == "x" else 64))
    s, _ = session(m, 0, report)
    feeds = {"x_in": activations(rng, 128), "x2": activations(rng, 64)}
    for (y, (q, x)), got in zip(qs.items(), s.run(list(qs), feeds)):
        ref = feeds["x_in" if x == "x" else x].astype(np.float64) @ exact_w(q).T
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("bits", [4, 8])
def test_folded_matrix_equals_the_exact_product_with_float_activations(bits):
    """Accuracy level 0 (float activations): the folded matrix and the graph as written both give
    the exact product, s == 0 blocks and clipped zero points included."""
    rng = np.random.default_rng(4)
    q = q41_like(64, 256, rng, bits)
    x = activations(rng, 256)
    ref = x.astype(np.float64) @ exact_w(q).T
    m, report = folded(q, 0)
    for got in (run(m, x, 0, report), run(matrix_graph(q), x, 0)):
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_folded_matrix_rounds_the_activations_for_the_minimum_too():
    """Accuracy level 4: the folded matrix = W applied to the int8-rounded x, the minimum's term
    included, as llama.cpp's Q4_1 x Q8_1 dot (up to the remainder r, |r| <= s/2, on the exact x);
    the graph as written rounds x only for the codes. So its error against the exact product is
    the smaller one."""
    rng = np.random.default_rng(5)
    q = q41_like(96, 512, rng)
    x = activations(rng, 512, rows=4)
    w = exact_w(q)
    ref = x.astype(np.float64) @ w.T
    xq = int8_activations(x)
    _, r = fold_weights(q.scales.T, q.mins.T, 8.0, 4)
    w_zp = w - np.repeat(r.T.astype(np.float64), B, axis=1)  # s*(c - zp): what the kernel multiplies
    blocksums = x.astype(np.float64).reshape(1, 4, -1, B).sum(-1)
    model = xq @ w_zp.T + blocksums @ r.astype(np.float64)
    m, report = folded(q, 4)
    got = run(m, x, 4, report)
    np.testing.assert_allclose(got, model, rtol=0, atol=1e-5 * np.abs(ref).max())
    err = lambda y: np.sqrt(((y - ref) ** 2).mean())  # noqa: E731
    as_written = run(matrix_graph(q), x, 4)
    assert err(got) < 0.9 * err(as_written)
    assert err(got) < 1.05 * err(xq @ w.T)  # llama.cpp's: every term on the rounded x


def test_a_minimum_on_the_code_grid_needs_no_remainder_term(tmp_path):
    """Blocks whose minimum is a whole number of steps (m = -k*s, Q4_0-like after the shift): the
    zero points carry all of it, the term goes, the matrix is one MatMulNBits, the product exact."""
    rng = np.random.default_rng(6)
    q = q41_like(32, 128, rng)
    q.scales[0, :3] = q.scales[0, 3]  # no s == 0 block here
    q.mins = (-q.scales * rng.integers(0, 16, q.scales.shape)).astype(np.float32)
    m, report = folded(q, 0)
    assert report.folded == report.exact_zero == 1 and not report.buffers
    assert sorted(n.op_type for n in optimized(m, report, tmp_path).node) == ["MatMulNBits"]
    x = activations(rng, 128)
    ref = x.astype(np.float64) @ exact_w(q).T
    np.testing.assert_allclose(run(m, x, 0, report), ref, rtol=0, atol=2e-5 * np.abs(ref).max())
