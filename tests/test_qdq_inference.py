"""int8_casts_to_qdq's shape inference runs on a stand-in without the weights' bytes (serializing
them into onnx's C++ inference, and moving them in and out of the graph around it, was seconds of
every real export) and the rewrite is unchanged by it."""
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import export.onnx_export as oe


def small_graph() -> onnx.ModelProto:
    """x [2, 64] @ W [64, 64] (16 KiB, a weight) -> reshape by an int64 shape -> round, clip ->
    Cast INT8 -> Cast FLOAT: the int8 round trip the exported graphs make."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((64, 64)) * 4).astype(np.float32), "W")
    shape = numpy_helper.from_array(np.array([4, 32], dtype=np.int64), "shape")
    lo, hi = numpy_helper.from_array(np.float32(-127), "lo"), numpy_helper.from_array(np.float32(127), "hi")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Reshape", ["y", "shape"], ["r"]),
             helper.make_node("Round", ["r"], ["rr"]), helper.make_node("Clip", ["rr", "lo", "hi"], ["c"]),
             helper.make_node("Cast", ["c"], ["q"], to=TensorProto.INT8),
             helper.make_node("Cast", ["q"], ["out"], to=TensorProto.FLOAT)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4, 32])], [w, shape, lo, hi])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def run(m: onnx.ModelProto, x):
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_shape_inference_gets_no_weight_bytes_and_the_rewrite_is_the_same(monkeypatch):
    m = small_graph()
    weight = {i.name: i.raw_data for i in m.graph.initializer}["W"]
    seen = []
    infer = onnx.shape_inference.infer_shapes

    def spy(model, *a, **k):
        seen.append(max(len(i.raw_data) for i in model.graph.initializer))
        seen.append({i.name: len(i.raw_data) for i in model.graph.initializer}["shape"])
        return infer(model, *a, **k)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", spy)
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    expected = run(m, x)  # the graph with its plain Casts: the oracle
    out = oe.int8_casts_to_qdq(m)
    assert seen and seen[0] <= oe.WEIGHT_BYTES  # the 16 KiB weight was not serialized into it
    assert seen[1] == 16  # the int64 shape Reshape reads kept its bytes
    assert {i.name: i.raw_data for i in out.graph.initializer}["W"] == weight  # in the result
    ops = [n.op_type for n in out.graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops and "Cast" not in ops
    onnx.checker.check_model(out, full_check=True)
    np.testing.assert_array_equal(run(out, x), expected)
