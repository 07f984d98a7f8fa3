"""A GGUF's fp16 block scales stored as fp16 (issue 23, "bytes"; docs/weights.md, "fp16 scales").

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 keep their scale d (and minimum m) as fp16 in the file; the bundle
stores them so too, behind a Cast to float32 (X_f16 -> Cast -> X), so that its weights cost what the
file's blocks do. Oracles: the gguf package's dequantization of the file (the bundle's own
DequantizeLinear, run by onnxruntime, bit for bit), the file's tensor bytes, and a bundle of the same
file from the float32-scale exporter (the same graph once the Casts are folded; the same logits and
greedy tokens). The tiny file is tied (the table is the head, SmolLM2's form) and mixes every such
type, fused parts of different types included."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from export.gguf_blocks import HALF_SCALES
from tests.conftest import make_hf_folder, made_once, run_dir

TYPES = {"token_embd": "Q8_0",
         "blk.0.attn_q": "Q4_0", "blk.0.attn_k": "Q4_0", "blk.0.attn_v": "Q4_1", "blk.0.attn_output": "Q5_0",
         "blk.0.ffn_gate": "Q4_1", "blk.0.ffn_up": "Q4_1", "blk.0.ffn_down": "Q5_1",
         "blk.1.attn_q": "Q8_0", "blk.1.attn_k": "Q8_0", "blk.1.attn_v": "Q8_0", "blk.1.attn_output": "Q4_1",
         "blk.1.ffn_gate": "Q5_0", "blk.1.ffn_up": "Q5_1", "blk.1.ffn_down": "Q4_0"}
# our matrix -> the file's tensors it is made of (the loader fuses q|k|v and gate|up)
PARTS = {"embed.weight": ["token_embd"]} | {
    f"layers.{i}.{ours}.weight": [f"blk.{i}.{t}" for t in theirs] for i in (0, 1)
    for ours, theirs in (("attn.wqkv", ("attn_q", "attn_k", "attn_v")), ("attn.wo", ("attn_output",)),
                         ("mlp.w_gate_up", ("ffn_gate", "ffn_up")), ("mlp.w_down", ("ffn_down",)))}


def _export(path, out):
    from export.pipeline import export_bundle

    return export_bundle(str(path), kv="float", out=str(out), max_context=64, steps=4, weights="auto")


def _float32_scale_export(path, out):
    """The same file through the exporter as it was: every scale and minimum a float32 initializer."""
    from export.weights import QuantWeight

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(QuantWeight, "half_scales", property(lambda self: False), raising=False)  # (older code: absent)
        return _export(path, out)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """(the tiny GGUF, its bundle, the float32-scale exporter's bundle of it)."""
    from tests.test_gguf_kquants import write_typed_gguf

    root = made_once(run_dir(tmp_path_factory) / "fp16-scales", lambda p: _make(p, write_typed_gguf))
    return root / "t.gguf", root / "half", root / "wide"


def _make(root, write_typed_gguf):
    folder = make_hf_folder(root / "hf", "llama", tie_word_embeddings=True)
    path = write_typed_gguf(folder, root / "t.gguf", lambda name: TYPES[name.rsplit(".", 1)[0]], seed=5)
    _export(path, root / "half")
    _float32_scale_export(path, root / "wide")


def _load(bundle) -> onnx.ModelProto:
    from edgekv.format.bundle import load_bundle

    return onnx.load(str(load_bundle(bundle).onnx_path))


def test_file_scales_are_stored_as_fp16_behind_a_cast(bundles):
    """Every DequantizeLinear of a matrix in HALF_SCALES types reads its scale through a Cast of an
    fp16 initializer (the minimum term its minimum too); no float32 scale or minimum is left."""
    from edgekv.format.bundle import load_bundle

    m = _load(bundles[1])
    inits = {i.name: i for i in m.graph.initializer}
    made = {o: n for n in m.graph.node for o in n.output}
    mats = load_bundle(bundles[1]).manifest["weights"]["matrices"]
    assert all(set(r["source"].split("|")) <= HALF_SCALES for r in mats.values())
    dqs = [n for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0].endswith("_q")
           and any(a.name == "block_size" for a in n.attribute)]
    assert len(dqs) == 2 * 4 + 1  # every projection and the head
    for side in [n.input[1] for n in dqs] + [t for t in inits if t.endswith("_min_f16")]:
        cast = made.get(side.removesuffix("_f16")) if side.endswith("_f16") else made.get(side)
        assert cast is not None and cast.op_type == "Cast", side
        assert inits[cast.input[0]].data_type == TensorProto.FLOAT16, side
    assert not [t for t in inits.values() if t.data_type == TensorProto.FLOAT and t.name.endswith(("_scale", "_min"))
                and len(t.dims) >= 2]
    assert all("fp16 scales" in r["carried"] for r in mats.values())


def test_matrices_cost_the_files_bytes(bundles):
    """A matrix of Q4_0, Q4_1 or Q8_0 costs in the bundle exactly what its tensors cost in the file
    (its codes at their width, its fp16 fields as fp16): the manifest's bytes against the GGUF
    reader's. (Q5_0/Q5_1 go as 8-bit codes: their 5th bit costs 3 more; a tied head nothing.)"""
    import gguf

    from edgekv.format.bundle import load_bundle

    path, bundle = bundles[0], bundles[1]
    sizes = {t.name.rsplit(".", 1)[0]: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    mats = load_bundle(bundle).manifest["weights"]["matrices"]
    same = [n for n, r in mats.items() if r["source"] in ("Q4_0", "Q4_1", "Q8_0") and n in PARTS]
    assert len(same) == 5
    for name in same:
        assert mats[name]["bytes"] == sum(sizes[p] for p in PARTS[name]), name
    assert mats["lm_head.weight"]["bytes"] == 0


def _run_nodes(m: onnx.ModelProto, nodes: list, out: str, out_type=TensorProto.FLOAT) -> np.ndarray:
    """onnxruntime running just `nodes` of `m` (weights loaded), unoptimized: the ops as written."""
    import onnxruntime as ort

    inits = {i.name: i for i in m.graph.initializer}
    g = helper.make_graph(nodes, "part", [], [helper.make_tensor_value_info(out, out_type, None)],
                          initializer=[inits[i] for n in nodes for i in n.input if i in inits])
    model = helper.make_model(g, opset_imports=list(m.opset_import))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, {})[0]


def test_the_bundles_dequantize_is_the_files_values_bit_for_bit(bundles):
    """onnxruntime's DequantizeLinear of each matrix without a minimum (Q4_0, Q5_0, Q8_0: there the
    DQ output is the weight), through the bundle's own Cast: the gguf package's dequantization bit
    for bit. The fp16 scale fed to the same DequantizeLinear directly is not (its output is fp16):
    why the Cast. Every matrix, minimums included, read back through the graph's arithmetic (the
    TensorRT staging's float32 scales): bit for bit too."""
    from edgekv.graph.passes.trt_staging import widen_half_scales
    from edgekv.graph.index import cone
    from tests.test_gguf_kquants import file_weights
    from tests.test_weights import decoded_weights

    path, bundle = bundles[0], bundles[1]
    ref = file_weights(path)
    ref["lm_head.weight"] = ref["embed.weight"]
    m = _load(bundle)
    made = {o: n for n in m.graph.node for o in n.output}
    plain = {"layers.0.attn.wo.weight", "layers.1.attn.wqkv.weight", "layers.1.mlp.w_down.weight", "lm_head.weight"}
    rounded = 0
    for name in plain:
        base = name.replace(".", "_")
        dq = made[base + "_dq"]
        codes = cone(dq.input[0], made, {i.name for i in m.graph.initializer})  # Q5_0's packed codes: unpacked by their nodes
        got = _run_nodes(m, codes + [made[dq.input[1]], dq], dq.output[0])  # [K, N]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.T, ref[name], err_msg=name)
        direct = helper.make_node("DequantizeLinear", [dq.input[0], dq.input[1] + "_f16"], ["w16"],
                                  axis=0, block_size=32)
        rounded += int((_run_nodes(m, codes + [direct], "w16", TensorProto.FLOAT16).astype(np.float32).T != ref[name]).sum())
    assert rounded > 0
    assert widen_half_scales(m, str(bundle))
    assert not any(t.data_type == TensorProto.FLOAT16 for t in m.graph.initializer)
    got = decoded_weights(m)
    assert set(got) == set(ref)
    for name in got:
        np.testing.assert_array_equal(got[name].astype(np.float32), ref[name], err_msg=name)


def _nodes(m) -> list:
    return [(n.op_type, list(n.input), list(n.output), sorted(a.SerializeToString() for a in n.attribute))
            for n in m.graph.node]


def _values(m) -> dict:
    return {i.name: (i.data_type, numpy_helper.to_array(i)) for i in m.graph.initializer}


def test_folding_the_casts_gives_the_float32_scale_graph(bundles):
    """The Casts folded (the runtime's pre-pass and the TensorRT staging: one function) leave the
    float32-scale exporter's graph: the same nodes in the same order, the same initializers by name
    and value."""
    from edgekv.graph.passes.trt_staging import widen_half_scales

    half, wide = _load(bundles[1]), _load(bundles[2])
    assert widen_half_scales(half, str(bundles[1]))
    assert _nodes(half) == _nodes(wide)
    a, b = _values(half), _values(wide)
    assert set(a) == set(b)
    for name in a:
        assert a[name][0] == b[name][0], name
        np.testing.assert_array_equal(a[name][1], b[name][1], err_msg=name)


def test_tensorrt_checks_the_graph_with_its_casts_folded(bundles):
    """check-trt on the bundle: every rule passes, as for the float32-scale bundle, with the same
    8-bit weights per channel; the bare graph as written is refused at each Cast-fed scale by a
    rule that names the Cast and the staging that folds it."""
    from edgekv.format.bundle import load_bundle
    from edgekv.format.trt_rules import check_as_built, check_model
    from edgekv.runtime.backends.engines import tensorrt_graph

    got = check_as_built(load_bundle(bundles[1]).onnx_path, "10.3", tensorrt_graph)
    assert got == check_as_built(load_bundle(bundles[2]).onnx_path, "10.3", tensorrt_graph)
    assert got[0] == [] and len(got[1]) == 5  # Q5_0, Q5_1, Q8_0 and the head: INT8 blocks, per channel
    m = onnx.load(str(load_bundle(bundles[1]).onnx_path), load_external_data=False)
    cast_rule = [v for v in check_model(m, "10.3") if "is a Cast of the fp16 constant" in v.rule]
    assert {v.node for v in cast_rule} == {n.name for n in m.graph.node if n.op_type == "DequantizeLinear"
                                           and n.input[1].endswith("_scale") and n.input[0].endswith("_q")}


@pytest.mark.parametrize("attention", ["plain", "fused"])
def test_tokens_unchanged_against_the_float32_scale_bundle(attention, bundles, monkeypatch):
    """The same file's two bundles on ort-cpu (int8 activations, the runtime's default): the same
    logits and greedy tokens, run as written (onnxruntime folding the Casts itself) and with the
    runtime's pre-pass in front of the minimum fold (ort.py: every minimum then folded into
    MatMulNBits as the float32-scale bundle's are)."""
    from edgekv.runtime.assemble import open_runtime
    from edgekv.runtime.backends.ort import MATMUL_ACCURACY, OrtBackend
    from tests.test_weights import greedy_logits

    half, wide = bundles[1], bundles[2]
    with open_runtime(half, 64, "ort-cpu", threads=1, log=None, attention=attention) as a, \
            open_runtime(wide, 64, "ort-cpu", threads=1, log=None, attention=attention) as b:
        assert a.backend.minimums.folded == b.backend.minimums.folded == 5  # every matrix with a minimum
    for fold in (True, False):
        monkeypatch.setattr(OrtBackend, "fold_minimums", fold)
        got, want = greedy_logits(half, attention, MATMUL_ACCURACY), greedy_logits(wide, attention, MATMUL_ACCURACY)
        np.testing.assert_array_equal(got[0], want[0])
        assert got[1] == want[1]


# --- the pre-pass itself --------------------------------------------------------------------

def _graph(cast_to=TensorProto.FLOAT, half=True, second_reader=False):
    s = np.array([[0.5, 0.25]], np.float16 if half else np.float32)
    nodes = [helper.make_node("Cast", ["s_f16"], ["s"], to=cast_to, name="widen"),
             helper.make_node("Mul", ["x", "s"], ["y"], name="mul")]
    if second_reader:
        nodes.append(helper.make_node("Identity", ["s_f16"], ["z"], name="other"))
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])]
    outs += [helper.make_tensor_value_info("z", TensorProto.FLOAT16, [1, 2])] if second_reader else []
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])], outs,
                          initializer=[numpy_helper.from_array(s, "s_f16")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def test_widening_takes_only_a_cast_of_an_fp16_initializer_to_float32():
    """The TensorRT staging's widen (and what the runtime's fold reads as a constant): only a Cast
    to float32 of an fp16 initializer read by nothing else."""
    from edgekv.graph.passes.trt_staging import widen_half_scales

    m = _graph()
    assert widen_half_scales(m, ".") == ["s"]
    assert [n.op_type for n in m.graph.node] == ["Mul"]
    (t,) = m.graph.initializer
    assert t.name == "s" and t.data_type == TensorProto.FLOAT
    np.testing.assert_array_equal(numpy_helper.to_array(t), [[0.5, 0.25]])
    for keep in (_graph(cast_to=TensorProto.FLOAT16), _graph(half=False), _graph(second_reader=True)):
        before = keep.SerializeToString()
        assert widen_half_scales(keep, ".") == [] and keep.SerializeToString() == before
