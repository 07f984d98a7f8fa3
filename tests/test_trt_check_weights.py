"""check-trt's rules for quantized weights (docs/tensorrt.md): block-wise DequantizeLinear only for
INT4, only on constant 2-D weights, opset >= 21 for INT4 (and 21 only for INT4 under 10.3), no
UINT4, an INT8 Gather only on a constant table whose rows go to DequantizeLinear. Each rule: a
clean graph passes, a planted violation is refused by node name."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekv.format.trt_rules import check_model

K, N = 64, 32


def model(nodes, inputs, outputs, inits, opset=21):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def vi(name, t, shape):
    return helper.make_tensor_value_info(name, t, list(shape))


def int4_weight(name="w", shape=(K, N), dtype=TensorProto.INT4):
    n = int(np.prod(shape))
    return helper.make_tensor(name, dtype, list(shape), bytes((n + 1) // 2), raw=True)


def scales(name="s", shape=(K // 32, N)):
    return numpy_helper.from_array(np.full(shape, 0.01, np.float32), name)


def block_matmul(w_init=None, opset=21, weight_input=False, block=32, scale_shape=(K // 32, N)):
    dq = helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], axis=0, block_size=block, name="dq_w")
    mm = helper.make_node("MatMul", ["x", "wf"], ["y"], name="mm")
    inputs = [vi("x", TensorProto.FLOAT, ("b", K))] + ([vi("w", TensorProto.INT4, (K, N))] if weight_input else [])
    inits = [scales(shape=scale_shape)] + ([] if weight_input else [w_init if w_init is not None else int4_weight()])
    return model([dq, mm], inputs, [vi("y", TensorProto.FLOAT, ("b", N))], inits, opset)


def names(v):
    return {x.node for x in v}


def test_int4_block_dq_matmul_passes_at_opset_21():
    assert check_model(block_matmul()) == []


def test_int4_below_opset_21_refused():
    v = check_model(block_matmul(opset=20))
    assert "dq_w" in names(v) and any("opset 21" in x.rule for x in v)


def test_per_tensor_int4_below_opset_21_refused():
    """INT4 itself needs opset 21, block-wise or not (this DQ has no block_size)."""
    s = numpy_helper.from_array(np.array(0.01, np.float32), "s")
    dq = helper.make_node("DequantizeLinear", ["w", "s"], ["wf"], name="dq_w")
    mm = helper.make_node("MatMul", ["x", "wf"], ["y"], name="mm")
    m = model([dq, mm], [vi("x", TensorProto.FLOAT, ("b", K))], [vi("y", TensorProto.FLOAT, ("b", N))],
              [s, int4_weight()], opset=20)
    v = check_model(m)
    assert any(x.node == "dq_w" and "INT4 needs opset 21" in x.rule for x in v)
    m.opset_import[0].version = 21
    assert check_model(m) == []


def test_opset_21_without_int4_still_refused_for_10_3():
    m = model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", TensorProto.FLOAT, (2,))],
              [vi("y", TensorProto.FLOAT, (2,))], [], opset=21)
    v = check_model(m, "10.3")
    assert "<model>" in names(v) and any("21 only for INT4" in x.rule for x in v)
    assert check_model(m, "10.15") == []


def test_opset_22_refused_for_10_3_even_with_int4():
    v = check_model(block_matmul(opset=22), "10.3")
    assert any(x.op == "opset" for x in v)


def test_block_dq_of_int8_refused():
    w = numpy_helper.from_array(np.zeros((K, N), np.int8), "w")
    v = check_model(block_matmul(w_init=w))
    assert "dq_w" in names(v) and any("only for INT4" in x.rule for x in v)


def test_block_dq_on_runtime_tensor_refused():
    v = check_model(block_matmul(weight_input=True))
    assert "dq_w" in names(v) and any("only on constant weights" in x.rule for x in v)


def test_block_dq_on_3d_weight_refused():
    w = int4_weight(shape=(2, K, N))
    v = check_model(block_matmul(w_init=w, scale_shape=(2, K // 32, N)))
    assert "dq_w" in names(v) and any("only 2-D weights" in x.rule for x in v)


def test_uint4_refused():
    w = int4_weight(dtype=TensorProto.UINT4)
    v = check_model(block_matmul(w_init=w))
    assert any(x.node == "w" and "TensorRT takes only signed INT4" in x.rule for x in v)


def _gather(table_const=True, consumer="DequantizeLinear"):
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    zp = numpy_helper.from_array(np.array(0, np.int8), "zp")
    tbl = numpy_helper.from_array(np.zeros((100, 16), np.int8), "tbl")
    nodes = [helper.make_node("Gather", ["tbl", "ids"], ["rows"], axis=0, name="g")]
    if consumer == "DequantizeLinear":
        nodes.append(helper.make_node("DequantizeLinear", ["rows", "one", "zp"], ["y"], name="dq_rows"))
    else:
        nodes.append(helper.make_node("Identity", ["rows"], ["r2"], name="bad_use"))
        nodes.append(helper.make_node("DequantizeLinear", ["r2", "one", "zp"], ["y"], name="dq_rows"))
    inputs = [vi("ids", TensorProto.INT64, ("b", "s"))] + ([] if table_const else [vi("tbl", TensorProto.INT8, (100, 16))])
    return model(nodes, inputs, [vi("y", TensorProto.FLOAT, ("b", "s", 16))], [one, zp] + ([tbl] if table_const else []), 18)


def test_int8_gather_on_constant_table_into_dq_passes():
    assert check_model(_gather()) == []


def test_int8_gather_on_runtime_table_refused():
    v = check_model(_gather(table_const=False))
    assert "g" in names(v) and any("not a constant table" in x.rule for x in v)


def test_int8_gathered_rows_used_outside_dq_refused():
    v = check_model(_gather(consumer="Identity"))
    assert any(x.node == "bad_use" and "consumes the INT8 rows" in x.rule for x in v)


@pytest.mark.parametrize("fmt", ["int4"])
def test_exported_int4_graph_passes_only_because_of_its_int4(fmt, tmp_path, tiny_llama):
    """The exporter's INT4 graph passes; the same graph with its INT4 weights swapped for INT8 blocks
    (what TensorRT refuses) is caught."""
    import onnx

    from export.pipeline import export_bundle
    from edgekv.format.bundle import load_bundle

    b = load_bundle(export_bundle(str(tiny_llama), kv="float", out=str(tmp_path / "b"), max_context=64, steps=2,
                                  weights=fmt))
    m = onnx.load(str(b.onnx_path), load_external_data=False)
    from edgekv.runtime.backends.engines import tensorrt_graph

    assert tensorrt_graph(m, b.onnx_path.parent) == ["lm_head_weight_q"]  # the 8-bit head, per channel for TensorRT
    assert check_model(m) == []
    victim = next(i for i in m.graph.initializer if i.data_type == TensorProto.INT4)
    dims = list(victim.dims)
    victim.CopyFrom(numpy_helper.from_array(np.zeros(dims, np.int8), victim.name))
    v = check_model(m)
    assert any("only for INT4" in x.rule for x in v)


def _half_scale_matmul():
    """INT4 block DQ -> MatMul whose scale is an fp16 initializer Cast to float32 (a bundle's form for
    a GGUF's fp16 block scales)."""
    m = block_matmul()
    s = next(i for i in m.graph.initializer if i.name == "s")
    s.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(s).astype(np.float16), "s_f16"))
    m.graph.node.insert(0, helper.make_node("Cast", ["s_f16"], ["s"], to=TensorProto.FLOAT, name="widen_s"))
    return m


def test_cast_fed_scale_named_and_folded_by_the_staging(tmp_path):
    """As written, the DQ's scale is a Cast's output: refused (TensorRT 10.3 wants the scale itself
    a constant) by a rule naming the Cast of the fp16 constant; checked as the engine build stages
    it (the Cast folded into a float32 initializer), every rule passes."""
    import onnx

    from edgekv.format.trt_rules import check_as_built

    m = _half_scale_matmul()
    v = check_model(m)
    assert names(v) == {"dq_w"} and "is a Cast of the fp16 constant s_f16" in v[0].rule
    onnx.save(m, str(tmp_path / "model.onnx"))
    assert check_as_built(tmp_path / "model.onnx", "10.3", lambda model, folder: []) == ([], [])
