"""The TensorRT parser-rule checker: exported graphs pass; planted violations are refused by name."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekv.format.bundle import load_bundle
from edgekv.format.trt_rules import check_model
from tests.conftest import cli


@pytest.mark.parametrize("kv", ["int8-static", "int8-tensor", "int4", "int4-norot"])
def test_every_scheme_exports_and_passes(kv, tiny_bundles):
    """(Each tiny export is conftest's, shared with any other test of that scheme.)"""
    assert check_model(load_bundle(tiny_bundles(kv)).onnx_path, "10.3") == []


def test_exported_bundles_pass(tiny_bundle_int8, tiny_bundle_float):
    for b in (tiny_bundle_int8, tiny_bundle_float):
        assert check_model(load_bundle(b).onnx_path, "10.3") == []
        r = cli("check-trt", b)
        assert r.returncode == 0 and "✓" in r.stdout


def graph(nodes, inputs, outputs, inits=(), opset=18):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def vi(name, t, shape=(2, 3)):
    return helper.make_tensor_value_info(name, t, list(shape))


ONE = numpy_helper.from_array(np.array(1.0, np.float32), "one")
ZP = numpy_helper.from_array(np.array(0, np.int8), "zp")


def names(violations):
    return {v.node for v in violations}


def test_clean_qdq_graph_passes():
    m = graph([helper.make_node("DequantizeLinear", ["x", "one", "zp"], ["f"], name="dq"),
               helper.make_node("QuantizeLinear", ["f", "one", "zp"], ["y"], name="q")],
              [vi("x", TensorProto.INT8)], [vi("y", TensorProto.INT8)], [ONE, ZP])
    assert check_model(m) == []


def test_cast_from_int8_refused():
    m = graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT, name="bad_cast")],
              [vi("x", TensorProto.INT8)], [vi("y", TensorProto.FLOAT)])
    v = check_model(m)
    assert "bad_cast" in names(v) and any("QuantizeLinear/DequantizeLinear" in x.rule for x in v)


def test_cast_to_int8_refused():
    m = graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.INT8, name="to_int8")],
              [vi("x", TensorProto.FLOAT)], [vi("y", TensorProto.INT8)])
    assert fires(m, "to_int8", "Cast FP32 -> INT8: TensorRT reaches quantized types only through")


def test_runtime_scale_refused_on_10_3_allowed_on_10_15():
    m = graph([helper.make_node("DequantizeLinear", ["x", "s", "zp"], ["y"], name="dq_runtime_scale")],
              [vi("x", TensorProto.INT8), vi("s", TensorProto.FLOAT, ())], [vi("y", TensorProto.FLOAT)], [ZP])
    v = check_model(m, "10.3")
    assert names(v) == {"dq_runtime_scale"} and "build-time constant" in v[0].rule
    assert check_model(m, "10.15") == []


def test_bitwise_op_refused():
    m = graph([helper.make_node("BitwiseAnd", ["a", "b"], ["y"], name="bitand")],
              [vi("a", TensorProto.UINT8), vi("b", TensorProto.UINT8)], [vi("y", TensorProto.UINT8)])
    v = check_model(m)
    assert "bitand" in names(v) and "not supported" in next(x for x in v if x.node == "bitand").rule


def test_contrib_op_refused():
    n = helper.make_node("GroupQueryAttention", ["a"], ["y"], name="gqa", domain="com.microsoft")
    m = graph([n], [vi("a", TensorProto.FLOAT)], [vi("y", TensorProto.FLOAT)])
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    assert fires(m, "gqa", "custom/contrib op from domain 'com.microsoft'")


def test_uint8_inside_network_refused():
    m = graph([helper.make_node("Cast", ["x"], ["u"], to=TensorProto.UINT8, name="to_u8"),
               helper.make_node("Cast", ["u"], ["y"], to=TensorProto.FLOAT, name="from_u8")],
              [vi("x", TensorProto.FLOAT)], [vi("y", TensorProto.FLOAT)])
    assert "to_u8" in names(check_model(m))
    # UINT8 at the network's edge, unpacked with Cast: fine (the int4 carrier)
    ok = graph([helper.make_node("Cast", ["u"], ["y"], to=TensorProto.FLOAT, name="unpack")],
               [vi("u", TensorProto.UINT8)], [vi("y", TensorProto.FLOAT)])
    assert check_model(ok) == []


def test_runtime_axes_and_opset_refused():
    m = graph([helper.make_node("ReduceMax", ["x", "axes"], ["y"], name="rmax")],
              [vi("x", TensorProto.FLOAT), vi("axes", TensorProto.INT64, (1,))], [vi("y", TensorProto.FLOAT)], opset=21)
    v = check_model(m, "10.3")
    assert "rmax" in names(v) and any("opset 21" in x.rule for x in v)


def test_per_channel_dq_on_activation_refused():
    s = numpy_helper.from_array(np.ones(3, np.float32), "s3")
    m = graph([helper.make_node("DequantizeLinear", ["x", "s3", "zp"], ["y"], axis=1, name="dq_pc")],
              [vi("x", TensorProto.INT8)], [vi("y", TensorProto.FLOAT)], [s, ZP])
    assert "dq_pc" in names(check_model(m))


def test_cli_reports_violations(tmp_path):
    m = graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT, name="bad_cast")],
              [vi("x", TensorProto.INT8)], [vi("y", TensorProto.FLOAT)])
    onnx.save(m, tmp_path / "m.onnx")
    r = cli("check-trt", tmp_path / "m.onnx")
    assert r.returncode == 1 and "bad_cast (Cast)" in r.stdout


def test_jetson_env_check_runs_anywhere():
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    r = subprocess.run([sys.executable, "-m", "jetson.env_check", "--json"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert "CPUExecutionProvider" in d["onnxruntime_providers"] and d["mem_total_mib"] > 0


# -- one planted violation per rule of edgekv/format/trt_rules.py: each test names the rule's own message,
# so it fails when that rule alone is switched off, even where another rule also fires

def rules(violations, node):
    return [v.rule for v in violations if v.node == node]


def fires(model, node, words, trt="10.3"):
    return any(words in r for r in rules(check_model(model, trt), node))


def test_int8_consumed_by_other_than_dequantize_refused():
    m = graph([helper.make_node("Relu", ["x"], ["y"], name="relu_on_int8")],
              [vi("x", TensorProto.INT8)], [vi("y", TensorProto.INT8)])
    assert fires(m, "relu_on_int8", "consumes INT8 tensor x; only DequantizeLinear may")


def test_int8_produced_other_than_by_quantize_refused():
    m = graph([helper.make_node("Cast", ["x"], ["q"], to=TensorProto.INT8, name="mk_int8"),
               helper.make_node("DequantizeLinear", ["q", "one", "zp"], ["y"], name="dq")],
              [vi("x", TensorProto.FLOAT)], [vi("y", TensorProto.FLOAT)], [ONE, ZP])
    assert fires(m, "mk_int8", "produces INT8 tensor q other than by QuantizeLinear")


def test_per_channel_quantize_on_activation_refused_on_weight_allowed():
    s = numpy_helper.from_array(np.ones(3, np.float32), "s3")
    z = numpy_helper.from_array(np.zeros(3, np.int8), "z3")
    m = graph([helper.make_node("QuantizeLinear", ["x", "s3", "z3"], ["q"], axis=1, name="q_pc"),
               helper.make_node("DequantizeLinear", ["q", "one", "zp"], ["y"], name="dq")],
              [vi("x", TensorProto.FLOAT)], [vi("y", TensorProto.FLOAT)], [s, z, ONE, ZP])
    assert fires(m, "q_pc", "per-channel QuantizeLinear")
    w = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    ok = graph([helper.make_node("QuantizeLinear", ["w", "s3", "z3"], ["q"], axis=1, name="q_w"),
                helper.make_node("DequantizeLinear", ["q", "s3", "z3"], ["y"], axis=1, name="dq_w")],
               [], [vi("y", TensorProto.FLOAT)], [w, s, z])
    assert rules(check_model(ok), "q_w") == []  # TensorRT folds Q of a constant weight


def test_per_tensor_dq_on_activation_and_per_channel_dq_on_weight_pass():
    s = numpy_helper.from_array(np.ones(3, np.float32), "s3")
    w = numpy_helper.from_array(np.ones((2, 3), np.int8), "w8")
    ok = graph([helper.make_node("DequantizeLinear", ["w8", "s3"], ["wf"], axis=1, name="dq_w"),
                helper.make_node("DequantizeLinear", ["x", "one", "zp"], ["xf"], name="dq_x"),
                helper.make_node("Add", ["wf", "xf"], ["y"], name="add")],
               [vi("x", TensorProto.INT8)], [vi("y", TensorProto.FLOAT)], [s, w, ONE, ZP])
    assert check_model(ok) == []


def test_runtime_zero_point_refused():
    m = graph([helper.make_node("DequantizeLinear", ["x", "one", "z"], ["y"], name="dq_rt_zp")],
              [vi("x", TensorProto.INT8), vi("z", TensorProto.INT8, ())], [vi("y", TensorProto.FLOAT)], [ONE])
    assert fires(m, "dq_rt_zp", "zero point z must be a build-time constant", trt="10.15")


def test_runtime_scale_refused_alone():
    m = graph([helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], name="q_rt"),
               helper.make_node("DequantizeLinear", ["q", "one", "zp"], ["y"], name="dq")],
              [vi("x", TensorProto.FLOAT), vi("s", TensorProto.FLOAT, ())], [vi("y", TensorProto.FLOAT)], [ONE, ZP])
    assert fires(m, "q_rt", "scale s is computed at run time")
    assert not fires(m, "q_rt", "scale s is computed at run time", trt="10.15")


def test_dequantize_of_unquantized_type_refused():
    m = graph([helper.make_node("DequantizeLinear", ["x", "one"], ["y"], name="dq_i32")],
              [vi("x", TensorProto.INT32)], [vi("y", TensorProto.FLOAT)], [ONE])
    assert fires(m, "dq_i32", "input type INT32: TensorRT dequantizes only quantized types")


def test_quantize_of_non_float_refused():
    z = numpy_helper.from_array(np.array(0, np.int8), "zp8")
    m = graph([helper.make_node("QuantizeLinear", ["x", "one", "zp8"], ["q"], name="q_i32"),
               helper.make_node("DequantizeLinear", ["q", "one", "zp8"], ["y"], name="dq")],
              [vi("x", TensorProto.INT32)], [vi("y", TensorProto.FLOAT)], [ONE, z])
    assert fires(m, "q_i32", "input type INT32 not supported")


def test_input_type_table_refuses_unlisted_type():
    m = graph([helper.make_node("MatMul", ["a", "b"], ["y"], name="mm_int")],
              [vi("a", TensorProto.INT32, (2, 3)), vi("b", TensorProto.INT32, (3, 2))], [vi("y", TensorProto.INT32, (2, 2))])
    assert fires(m, "mm_int", "input type INT32 not supported (TensorRT takes FP32, FP16, BF16)")
    ok = graph([helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")],
               [vi("a", TensorProto.FLOAT, (2, 3)), vi("b", TensorProto.FLOAT, (3, 2))], [vi("y", TensorProto.FLOAT, (2, 2))])
    assert check_model(ok) == []


def test_where_is_typed_by_its_data_input_not_its_condition():
    # Where's input 0 is the BOOL condition (which the table allows); its data is input 1
    m = graph([helper.make_node("Where", ["c", "x", "x"], ["y"], name="where_u8")],
              [vi("c", TensorProto.BOOL), vi("x", TensorProto.UINT8)], [vi("y", TensorProto.UINT8)])
    assert fires(m, "where_u8", "input type UINT8 not supported")


def test_cast_from_unsupported_type_refused():
    m = graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT, name="from_f64")],
              [vi("x", TensorProto.DOUBLE)], [vi("y", TensorProto.FLOAT)])
    assert fires(m, "from_f64", "Cast from DOUBLE is not supported")


def test_runtime_constant_input_refused_alone():
    m = graph([helper.make_node("Unsqueeze", ["x", "axes"], ["y"], name="unsq")],
              [vi("x", TensorProto.FLOAT), vi("axes", TensorProto.INT64, (1,))], [vi("y", TensorProto.FLOAT, (1, 2, 3))])
    assert fires(m, "unsq", "input 1 (axes) must be a build-time constant")
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes_c")
    ok = graph([helper.make_node("Unsqueeze", ["x", "axes_c"], ["y"], name="unsq")],
               [vi("x", TensorProto.FLOAT)], [vi("y", TensorProto.FLOAT, (1, 2, 3))], [axes])
    assert check_model(ok) == []


def relu(opset):
    return graph([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", TensorProto.FLOAT)],
                 [vi("y", TensorProto.FLOAT)], opset=opset)


@pytest.mark.parametrize("opset,trt,ok", [(21, "10.3", False), (20, "10.3", True), (8, "10.3", False),
                                          (9, "10.3", True), (21, "10.15", True), (25, "10.15", False)])
def test_opset_range(opset, trt, ok):
    assert fires(relu(opset), "<model>", f"opset {opset} outside", trt) != ok


def test_foreign_domain_import_refused_without_nodes():
    m = relu(18)
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    assert fires(m, "<model>", "non-standard domain 'com.microsoft' imported")


def test_op_missing_from_the_table_refused():
    m = graph([helper.make_node("Frobnicate", ["x"], ["y"], name="frob")],
              [vi("x", TensorProto.FLOAT)], [vi("y", TensorProto.FLOAT)])
    assert fires(m, "frob", "not supported by TensorRT's ONNX parser")


def test_op_newer_than_the_version_refused_on_it_only():
    m = graph([helper.make_node("Gelu", ["x"], ["y"], name="gelu")],
              [vi("x", TensorProto.FLOAT)], [vi("y", TensorProto.FLOAT)], opset=20)
    assert fires(m, "gelu", "not in TensorRT 10.3's parser")
    assert check_model(m, "10.15") == []


def test_unknown_trt_version_refused():
    with pytest.raises(ValueError, match="unknown TensorRT version"):
        check_model(relu(18), "9.9")


def test_mutated_export_is_refused(tiny_bundle_int8):
    """A planted violation in a real exported graph: one DequantizeLinear of the KV cache replaced
    by a Cast (the int8 past read without its scale)."""
    m = onnx.load(str(load_bundle(tiny_bundle_int8).onnx_path), load_external_data=False)
    n = next(n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("past"))
    n.op_type, n.name = "Cast", "planted_cast"
    del n.input[1:]
    n.attribute.append(helper.make_attribute("to", TensorProto.FLOAT))
    v = check_model(m)
    assert any("QuantizeLinear/DequantizeLinear" in r for r in rules(v, "planted_cast")), v


@pytest.mark.parametrize("content", [b"", b"\x00\xff garbage \x13\x37" * 50, b"hello world\n"])
def test_cli_refuses_a_file_that_is_not_onnx(tmp_path, content):
    f = tmp_path / "bad.onnx"
    f.write_bytes(content)
    r = cli("check-trt", f)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode != 0 and "Traceback" not in r.stderr and "✓" not in r.stdout
    assert len(lines) == 1 and "not an ONNX model" in lines[0], r.stderr
