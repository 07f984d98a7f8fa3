"""The TensorRT parser-rule checker: exported graphs pass; planted violations are refused by name."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekv.format.bundle import load_bundle
from edgekv.tools.trt_check import check_model
from tests.conftest import run_edgekv


@pytest.mark.parametrize("kv", ["int8-static", "int8-tensor", "int4", "int4-norot"])
def test_every_scheme_exports_and_passes(kv, tiny_llama, tmp_path):
    from export.bundle import export_bundle

    b = export_bundle(str(tiny_llama), kv=kv, out=str(tmp_path / kv), max_context=128, steps=4)
    assert check_model(load_bundle(b).onnx_path, "10.3") == []


def test_exported_bundles_pass(tiny_bundle_int8, tiny_bundle_float):
    for b in (tiny_bundle_int8, tiny_bundle_float):
        assert check_model(load_bundle(b).onnx_path, "10.3") == []
        r = run_edgekv("check-trt", b)
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
    assert "to_int8" in names(check_model(m))


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
    v = check_model(m)
    assert "gqa" in names(v) and any("com.microsoft" in x.rule for x in v)


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
    r = run_edgekv("check-trt", tmp_path / "m.onnx")
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
