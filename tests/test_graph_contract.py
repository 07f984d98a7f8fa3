"""The exported graph follows the contract of docs/graph.md."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from edgekv.format.bundle import load_bundle


@pytest.fixture(params=["int8", "float"])
def bundle(request, tiny_bundle_int8, tiny_bundle_float):
    return load_bundle(tiny_bundle_int8 if request.param == "int8" else tiny_bundle_float)


def _dims(v):
    return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]


def test_io_names_types_and_layout(bundle):
    m = onnx.load(str(bundle.onnx_path), load_external_data=False)
    ins = {v.name: v for v in m.graph.input}
    outs = {v.name: v for v in m.graph.output}
    md = bundle.model
    assert list(ins)[:4] == ["input_ids", "position_ids", "key_mask", "logits_index"]
    assert ins["key_mask"].type.tensor_type.elem_type == TensorProto.BOOL
    assert ins["logits_index"].type.tensor_type.elem_type == TensorProto.INT64
    assert list(outs)[0] == "logits"
    assert _dims(outs["logits"])[-1] == md["vocab_size"]
    kv_type = TensorProto.INT8 if bundle.scheme.name == "int8" else TensorProto.FLOAT
    for i in range(md["n_layers"]):
        for kv in ("key", "value"):
            p, q = ins[f"past.{i}.{kv}"], outs[f"present.{i}.{kv}"]
            assert p.type.tensor_type.elem_type == kv_type == q.type.tensor_type.elem_type
            assert _dims(p)[2:] == [md["n_kv_heads"], md["head_dim"]]  # [P, B, Hkv, D]
            assert _dims(q)[2:] == [md["n_kv_heads"], md["head_dim"]]  # [S, B, Hkv, D]: only the new tokens
            assert _dims(q)[0] == _dims(ins["input_ids"])[1]  # present's slot dim is S
            if bundle.scheme.name == "int8":
                s = ins[f"past.{i}.{kv}_scale"]
                assert s.type.tensor_type.elem_type == TensorProto.FLOAT16
                assert _dims(s)[2:] == [md["n_kv_heads"]]


def test_standard_ops_opset_and_checker(bundle):
    m = onnx.load(str(bundle.onnx_path))
    onnx.checker.check_model(m, full_check=True)
    assert all(o.domain in ("", "ai.onnx") for o in m.opset_import)
    assert max(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")) <= 18
    assert all(n.domain in ("", "ai.onnx") for n in m.graph.node), "contrib ops"
    assert not any(n.op_type.startswith("Sequence") or n.op_type == "SplitToSequence" for n in m.graph.node)


def test_int8_only_through_unit_scale_qdq(tiny_bundle_int8):
    b = load_bundle(tiny_bundle_int8)
    m = onnx.shape_inference.infer_shapes(onnx.load(str(b.onnx_path)))
    types = {v.name: v.type.tensor_type.elem_type for v in [*m.graph.input, *m.graph.value_info, *m.graph.output]}
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    consts = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in m.graph.node
              if n.op_type == "Constant" and n.attribute[0].name == "value"}
    inits.update(consts)
    q = dq = 0
    for n in m.graph.node:
        if n.op_type == "Cast":
            to = next(a.i for a in n.attribute if a.name == "to")
            assert to != TensorProto.INT8, f"Cast to INT8: {n.name}"
            assert types.get(n.input[0]) != TensorProto.INT8, f"Cast from INT8: {n.name}"
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            q += n.op_type == "QuantizeLinear"
            dq += n.op_type == "DequantizeLinear"
            scale, zp = inits[n.input[1]], inits[n.input[2]]
            assert scale.shape == () and float(scale) == 1.0, n.name
            assert zp.shape == () and zp.dtype == np.int8 and int(zp) == 0, n.name
    layers = b.model["n_layers"]
    assert q == 2 * layers and dq == 2 * layers  # K and V out, K and V in, per layer
