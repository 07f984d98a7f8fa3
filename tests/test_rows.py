"""Weight products whose rows do not depend on the call's row count (edgekv/runtime/backends/rows.py).
Oracles: a many-row call of the same kernel (the padded single row must be one of its rows, bit for
bit), and the lone decode (batched = alone) on a bundle of 4- and 8-bit blocks."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T, helper as h, numpy_helper as nh

from edgekv.runtime.assemble import open_runtime
from edgekv.runtime.backends.rows import (FLOAT, Kind, RowPlan, pad_single_rows, plan_rows, rows_differ,
                                          weight_products)
from edgekv.graph.forms import Handed
from edgekv.runtime.backends.nbits8 import fuse_8bit
from tests.test_int4_determinism import assert_same
from tests.test_serve_engine import alone, batch_schedule

K, N, B = 64, 48, 32


def ort_version() -> str:
    import onnxruntime as ort

    return ort.__version__


def product_graph(bits: int, rank: int = 3) -> onnx.ModelProto:
    """x [.., K] -> DequantizeLinear(codes, scales, zero points) block-wise -> MatMul, and the same x
    through a float MatMul: both kinds of product in one graph."""
    rng = np.random.default_rng(bits)
    lo, hi, ty = (-8, 8, T.INT4) if bits == 4 else (-128, 128, T.INT8)
    inits = [h.make_tensor("c", ty, [K, N], rng.integers(lo, hi, (K, N)).ravel().tolist()),
             nh.from_array((rng.random((K // B, N)) * 0.05 + 1e-3).astype(np.float32), "s"),
             h.make_tensor("z", ty, [K // B, N], rng.integers(-2, 2, (K // B, N)).ravel().tolist()),
             nh.from_array(rng.standard_normal((K, N)).astype(np.float32), "f")]
    dims = ["b", "s", K][-rank:]
    g = h.make_graph([h.make_node("DequantizeLinear", ["c", "s", "z"], ["d"], axis=0, block_size=B),
                      h.make_node("MatMul", ["x", "d"], ["q"], name="quantized"),
                      h.make_node("MatMul", ["x", "f"], ["y"], name="float")], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, dims)],
                     [h.make_tensor_value_info(o, T.FLOAT, dims[:-1] + [N]) for o in ("q", "y")], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 21)], ir_version=10)


def as_loaded(model) -> onnx.ModelProto:
    """The graph as the backend has it before the rows pass: 8-bit block weights written as
    MatMulNBits where this onnxruntime does not fuse them itself (nbits8.py, < 1.25)."""
    import onnxruntime as ort

    graph, handed, _ = fuse_8bit(model.SerializeToString(), ".", Handed(), ort, 4)
    out = onnx.load_from_string(graph)
    for name, a in handed.buffers:  # in the graph itself, for a plain session
        t = next(t for t in out.graph.initializer if t.name == name)
        t.CopyFrom(nh.from_array(a, name))
    return out


def session(model, tmp_path=None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4")
    if tmp_path is not None:
        opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    s = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return lambda x: s.run(None, {"x": x})


def test_weight_products_finds_each_kind():
    found = {n.name: (kind, n_out) for n, kind, n_out in weight_products(product_graph(4))}
    assert found == {"quantized": (Kind(4, B, True, K), N), "float": (Kind(FLOAT, 0, False, K), N)}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rank", [2, 3])
def test_a_padded_single_row_is_a_row_of_a_many_row_call(bits, rank, tmp_path):
    """Padded, a one-row call gives the bits that row gets among others in an unpadded call (the
    oracle: the same kernel's many-row path), and a many-row call gives what it gave unpadded;
    onnxruntime still runs the quantized product as MatMulNBits."""
    model = as_loaded(product_graph(bits, rank))
    plain = session(model)
    padded_model = as_loaded(product_graph(bits, rank))
    assert pad_single_rows(padded_model, {Kind(bits, B, True, K), Kind(FLOAT, 0, False, K)}) == 2
    onnx.checker.check_model(padded_model, full_check=True)
    padded = session(padded_model, tmp_path)
    ops = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert "MatMulNBits" in ops
    x = np.random.default_rng(3).standard_normal((5, K)).astype(np.float32)
    shaped = (lambda a: a) if rank == 2 else (lambda a: a[None])  # [1, M, K]
    many = plain(shaped(x))
    for i in range(len(x)):
        got = padded(shaped(x[i:i + 1]))
        for g, w in zip(got, many):
            assert g.shape == shaped(x[i:i + 1]).shape[:-1] + (N,)
            np.testing.assert_array_equal(g.reshape(-1, N)[0], w.reshape(-1, N)[i])
    for g, w in zip(padded(shaped(x)), many):
        np.testing.assert_array_equal(g, w)
    if rank == 3:  # several entries and tokens flatten into rows and come back in their places
        x3 = np.random.default_rng(4).standard_normal((3, 2, K)).astype(np.float32)
        for g, w in zip(padded(x3), plain(x3)):
            np.testing.assert_array_equal(g, w)


def test_plan_pads_where_the_single_row_differs_and_refuses_where_many_rows_differ():
    kinds = {Kind(4, B, True, K): (True, False), Kind(FLOAT, 0, False, K): (False, False)}
    plan = plan_rows(product_graph(4), 1, 4, prober=lambda kind, t, a: kinds[kind])
    assert plan.padded == {Kind(4, B, True, K)} and plan.exact and "two rows" in plan.line()
    kinds[Kind(FLOAT, 0, False, K)] = (True, True)
    plan = plan_rows(product_graph(4), 1, 4, prober=lambda kind, t, a: kinds[kind])
    assert not plan.exact and "does not hold" in plan.line()
    assert RowPlan().line() is None and RowPlan().exact


def test_rows_differ_sees_a_single_row_path_and_a_tile_path():
    """The probe's comparison itself, on products whose rounding depends on the row count by construction."""
    w = np.random.default_rng(5).standard_normal((K, N)).astype(np.float32)
    single_path = lambda x: (x.astype(np.float64) @ w).astype(np.float32) if len(x) == 1 else x @ w  # noqa: E731
    tile_path = lambda x: x @ w + (np.float32(1e-3) if len(x) % 2 else 0)  # noqa: E731
    assert rows_differ(single_path, K)[0]
    assert rows_differ(tile_path, K)[1]
    assert rows_differ(lambda x: np.stack([r @ w for r in x]), K) == (False, False)


def test_the_backend_reports_what_it_found(tiny_bundle_int8_wint4):
    with open_runtime(tiny_bundle_int8_wint4, ctx=64, backend="ort-cpu", threads=1) as rt:
        plan = rt.backend.rows
        kinds = {k for _, k, _ in weight_products(onnx.load(str(rt.bundle.onnx_path), load_external_data=False))}
        assert {k.bits for k in kinds} >= {4, 8}  # the bundle holds both block widths
        assert plan.exact, plan.line()  # every CPU onnxruntime dispatches to: x86 AVX2/AVX-512, aarch64


def test_tiny_int4_weights_batched_equals_alone_bit_for_bit(tiny_bundle_int8_wint4):
    """4-bit and 8-bit MatMulNBits and the exact attention: the serving schedule (a lone step of
    one row, steps of several, prefill chunks) gives every sequence its lone decode's logits."""
    with open_runtime(tiny_bundle_int8_wint4, ctx=256, backend="ort-cpu", threads=1) as rt:
        assert rt.backend.exact
        engine = rt.batcher(capacity=256, parallel=4, prefill_chunk=8)
        spec, reqs, _ = batch_schedule(engine)
        for k, (prompt, n) in spec.items():
            assert_same(reqs[k].out, reqs[k].logits, *alone(rt, prompt, n), k)


def test_tiny_int4_weights_fused_slots_batched_equals_alone(tiny_gguf_bundles):
    """serve's fused slots on 4-bit weights: a lone request's decode steps are one-row calls, the
    same request beside others many-row ones; logits and tokens equal bit for bit."""
    from tests.test_fused_serve import CTX, SPEC, alone as alone_in_slots, schedule, slots_engine

    from edgekv.runtime.backends.fused import QUERY_LENGTHS_ORT, ort_at_least

    if not ort_at_least(ort_version(), QUERY_LENGTHS_ORT):
        pytest.skip(f"onnxruntime {ort_version()} has no GroupQueryAttention query_seqlens (serve's slots need 1.32)")
    with open_runtime(tiny_gguf_bundles("int8-static"), ctx=CTX, backend="ort-cpu", threads=1, attention="fused") as rt:
        reqs, _, _ = schedule(slots_engine(rt))
        for k, (prompt, n) in SPEC.items():
            want = alone_in_slots(rt, prompt, n)
            assert_same(reqs[k].out, reqs[k].logits, want.out, want.logits, k)
