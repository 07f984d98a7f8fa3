"""GGUF block types kept exactly (docs/weights.md): Q4_0, Q4_1, Q4_K as INT4 codes, Q5_0, Q5_1,
Q5_K, Q6_K, Q8_0 as INT8 codes, each with its exact float32 block scales (and minimums).

Oracle: the gguf package's own `gguf.quants.dequantize` of the file. Tiny GGUFs are written with
the gguf package's writer in llama.cpp's layout (tests/test_gguf.py), holding random valid blocks:
random codes and 6-bit scales/mins, fp16 super-block scales in a realistic range (the gguf package
has no quantizer for the K-quants, and random blocks reach codes a quantizer rarely writes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from export.gguf_blocks import DECODERS
from export.weights import auto_format, concat_rows, from_gguf_blocks, plan_weights
from tests.conftest import make_hf_folder

TYPES = sorted(DECODERS)
# where each type keeps its fp16 fields in a block, and a magnitude that gives weights ~0.1-1
F16_FIELDS = {"Q8_0": {0: 4e-3}, "Q4_0": {0: 2e-2}, "Q4_1": {0: 2e-2, 2: -0.15}, "Q5_0": {0: 1e-2},
              "Q5_1": {0: 1e-2, 2: -0.15}, "Q4_K": {0: 3e-4, 2: 2e-3}, "Q5_K": {0: 2e-4, 2: 2e-3},
              "Q6_K": {208: 1e-4}}


def random_blocks(kind: str, n: int, k: int, rng, spread: float = 0.5) -> np.ndarray:
    """Random valid blocks of `kind` for a matrix [n, k], as the file stores them [n, bytes per row]:
    every code and sub-block scale byte random, the fp16 scales random around the type's magnitude
    (log-uniform over `spread` decades either way)."""
    import gguf

    _, per, nbytes = DECODERS[kind]
    raw = rng.integers(0, 256, (n * k // per, nbytes), dtype=np.uint8)
    for at, mag in F16_FIELDS[kind].items():
        v = mag * 10.0 ** rng.uniform(-spread, spread, raw.shape[0]) * rng.choice([-1.0, 1.0], raw.shape[0])
        raw[:, at:at + 2] = np.abs(v).astype(np.float16).view(np.uint8).reshape(-1, 2) if at == 2 and "K" in kind \
            else v.astype(np.float16).view(np.uint8).reshape(-1, 2)  # a K-quant's dmin is >= 0 in files
    assert gguf.GGMLQuantizationType[kind].name == kind
    return raw.reshape(n, -1)


def file_weights(path) -> dict[str, np.ndarray]:
    """Our name -> the gguf package's dequantization of the file's tensor (q/k rows unpermuted,
    fused matrices concatenated as the loader does): the oracle."""
    import gguf

    from export.checkpoint_names import GGUF_NAMES, rename
    from export.gguf_loader import _unpermute
    from export.model_config import ModelConfig

    r = gguf.GGUFReader(str(path))
    f = lambda key: r.fields[key].contents()  # noqa: E731
    embd = next(t for t in r.tensors if t.name == "token_embd.weight")
    cfg = ModelConfig(arch="llama", vocab_size=int(embd.shape[-1]),
                      hidden_size=f("llama.embedding_length"), intermediate_size=f("llama.feed_forward_length"),
                      n_layers=f("llama.block_count"), n_heads=f("llama.attention.head_count"),
                      n_kv_heads=f("llama.attention.head_count_kv"),
                      head_dim=f("llama.embedding_length") // f("llama.attention.head_count"),
                      tie_word_embeddings=not any(t.name == "output.weight" for t in r.tensors))
    ref = {}
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)])
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, cfg.n_heads)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, cfg.n_kv_heads)
        ref[t.name] = torch.from_numpy(np.ascontiguousarray(w))
    return {k: v.numpy() for k, v in rename(ref, GGUF_NAMES, cfg).items() if v.dim() == 2}


def tiny_kquant_folder(path):
    # every K a multiple of 256 (the K-quants' super-block), two layers
    return make_hf_folder(path, "llama", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                          num_key_value_heads=2)


def write_typed_gguf(folder, path, types, seed=0):
    """A tiny GGUF whose 2-D tensors have the block types `types(name)`, random valid blocks."""
    import gguf

    from tests.test_gguf import write_gguf

    rng = np.random.default_rng(seed)
    T = gguf.GGMLQuantizationType
    write_gguf(folder, path, quant=lambda name: T[types(name)],
               encode=lambda name, w, qtype: random_blocks(qtype.name, w.shape[0], w.shape[1], rng))
    return path


@pytest.fixture(scope="module")
def kfolder(tmp_path_factory):
    return tiny_kquant_folder(tmp_path_factory.mktemp("kq") / "hf")


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_loads_bit_for_bit(kind, kfolder, tmp_path):
    """A tiny GGUF all in `kind`: every matrix's kept blocks (under our names, q/k unpermuted,
    q|k|v and gate|up fused) dequantize to the gguf package's values bit for bit, in the carrier
    the type is meant for."""
    from export.gguf_loader import load_gguf

    path = write_typed_gguf(kfolder, tmp_path / f"{kind}.gguf", lambda name: kind)
    src = load_gguf(path)
    ref = file_weights(path)
    assert set(src.blocks) == set(ref)
    for name, q in src.blocks.items():
        np.testing.assert_array_equal(q.dequantize(), ref[name], err_msg=f"{kind} {name}")
        assert q.bits == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8) and q.source == kind
        assert q.block == (16 if kind == "Q6_K" else 32)
        lo, hi = (-8, 7) if q.bits == 4 else (-128, 127)
        assert lo <= q.codes.min() and q.codes.max() <= hi


@pytest.mark.parametrize("kind", TYPES)
def test_wide_scales_stay_exact(kind):
    """Scales over eight decades (the sub-block products d·sc, the K-quants' minimums against
    their scales): still bit for bit. For Q4_1/Q4_K some blocks' 8s + m is not a float32, which
    is why the graph keeps s and m apart rather than one M = 8s + m."""
    import gguf

    rng = np.random.default_rng(1)
    n, k = 16, 512
    raw = random_blocks(kind, n, k, rng, spread=4)
    q = from_gguf_blocks(kind, raw, (n, k))
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32).reshape(n, k)
    np.testing.assert_array_equal(q.dequantize(), ref)
    if q.shift:
        m = q.mins.astype(np.float64) + q.shift * q.scales.astype(np.float64)
        assert (m.astype(np.float32) != m).any()  # a single float32 M would lose these


def test_fused_parts_of_mixed_types_meet_exactly():
    """q|k|v of Q5_0, Q5_0, Q8_0 (Q4_K_M's usual mix on a 576-wide model), gate|up of Q4_K and
    Q6_K, and Q4_0 beside Q4_1: one carrier each, the same values."""
    rng = np.random.default_rng(2)
    for kinds in (["Q5_0", "Q5_0", "Q8_0"], ["Q4_K", "Q6_K"], ["Q4_0", "Q4_1", "Q4_K"], ["Q5_1", "Q4_0"]):
        parts = [from_gguf_blocks(t, random_blocks(t, 8, 256, rng), (8, 256)) for t in kinds]
        fused = concat_rows(parts)
        np.testing.assert_array_equal(fused.dequantize(), np.concatenate([p.dequantize() for p in parts]))
        assert fused.bits == max(p.bits for p in parts) and fused.source == "|".join(kinds)


def test_auto_keeps_what_the_file_holds():
    e, h = "embed.weight", "lm_head.weight"
    q4km = {"a": {"Q5_0", "Q8_0"}, "b": {"Q5_0"}, "c": {"Q6_K"}, "d": {"Q4_K"}, e: {"Q8_0"}}
    assert auto_format(q4km, e, h) == "int4"
    assert auto_format({"a": {"Q5_0", "Q8_0"}, "c": {"Q6_K"}, "d": {"Q5_K"}}, e, h) == "int8"
    assert auto_format({"a": {"Q4_K"}, "b": {"IQ4_XS"}}, e, h) == "float"
    assert auto_format({"a": {"Q4_K"}, "b": {"F16"}}, e, h) == "float"
    # what the loader keeps says the same (a fused matrix's source as recorded: "Q5_0|Q8_0")
    assert auto_format({"a": {"Q5_0|Q8_0"}, "d": {"Q4_K"}}, e, h) == "int4"
    assert auto_format({"a": {"Q5_0|IQ4_XS"}}, e, h) == "float"


def test_int8_carries_4bit_blocks_exactly_and_int4_never_narrows_wider_codes():
    """--weights int8 on a Q4_K matrix: its codes as 8-bit, the same values (not requantized);
    --weights int4 on a Q6_K matrix: kept at 8 bits, the same values (never narrowed to 4)."""
    rng = np.random.default_rng(3)
    kept = {n: from_gguf_blocks(t, random_blocks(t, 32, 256, rng), (32, 256))
            for n, t in (("x.weight", "Q4_K"), ("y.weight", "Q6_K"), ("embed.weight", "Q5_1"), ("lm_head.weight", "Q8_0"))}
    state = {n: q.dequantize() for n, q in kept.items()}
    for fmt in ("int8", "int4"):
        plan = plan_weights(state, kept, fmt, 32, "embed.weight", "lm_head.weight")
        for n, q in plan.items():
            np.testing.assert_array_equal(q.dequantize(), state[n], err_msg=f"{fmt} {n}")
        assert plan["x.weight"].bits == (8 if fmt == "int8" else 4) and plan["y.weight"].bits == 8


# --- a Q4_K_M-style file, end to end -----------------------------------------------------------

MIXED = {  # llama.cpp's Q4_K_M mixes (Q5_0/Q8_0 where a row is not a multiple of 256), plus every other type
    "token_embd": "Q4_K", "output": "Q6_K",
    "blk.0.attn_q": "Q5_0", "blk.0.attn_k": "Q5_0", "blk.0.attn_v": "Q8_0", "blk.0.attn_output": "Q4_K",
    "blk.0.ffn_gate": "Q4_K", "blk.0.ffn_up": "Q4_K", "blk.0.ffn_down": "Q6_K",
    "blk.1.attn_q": "Q4_K", "blk.1.attn_k": "Q4_0", "blk.1.attn_v": "Q4_1", "blk.1.attn_output": "Q5_1",
    "blk.1.ffn_gate": "Q5_K", "blk.1.ffn_up": "Q5_K", "blk.1.ffn_down": "Q4_1",
}


@pytest.fixture(scope="module")
def mixed_bundle(kfolder, tmp_path_factory):
    from export.pipeline import export_bundle

    root = tmp_path_factory.mktemp("kqmix")
    path = write_typed_gguf(kfolder, root / "mixed.gguf", lambda name: MIXED[name.rsplit(".", 1)[0]], seed=4)
    return path, export_bundle(str(path), kv="float", out=str(root / "b"), max_context=64, steps=4, weights="auto")


def test_mixed_file_exports_with_its_blocks_bit_for_bit(mixed_bundle):
    """`--weights auto` on a Q4_K_M-style file: int4, parity passed, and the bundle's weights read
    back from its ONNX initializers through the graph's own DQ arithmetic (codes + shift) * scale
    + min (its fp16 scales widened as the TensorRT staging does) equal the gguf package's
    dequantization of the file bit for bit; the manifest says per matrix what the file held and how
    it is carried."""
    import onnx

    from edgekv.format.bundle import load_bundle
    from edgekv.graph.passes.trt_staging import widen_half_scales
    from tests.test_weights import decoded_weights

    path, bundle = mixed_bundle
    b = load_bundle(bundle)
    man = b.manifest
    assert man["weights"]["format"] == "int4" and man["parity"]["passed"]
    ref = file_weights(path)
    m = onnx.load(str(b.onnx_path))
    assert widen_half_scales(m, str(b.onnx_path.parent))
    got = decoded_weights(m)
    assert set(got) == set(ref)
    for name in got:
        np.testing.assert_array_equal(got[name].astype(np.float32), ref[name], err_msg=name)
    mats = man["weights"]["matrices"]
    assert mats["layers.0.attn.wqkv.weight"]["source"] == "Q5_0|Q5_0|Q8_0"
    assert mats["layers.0.attn.wqkv.weight"]["carried"].startswith("INT8 blocks of 32")
    assert mats["layers.1.attn.wqkv.weight"]["carried"].startswith("INT4 blocks of 32")
    assert mats["layers.0.mlp.w_down.weight"]["carried"].startswith("INT8 blocks of 16")
    assert mats["embed.weight"]["source"] == "Q4_K" and "min" in mats["embed.weight"]["carried"]


def test_scales_are_stored_as_the_file_holds_them(mixed_bundle):
    """A matrix all of whose parts keep fp16 scales in the file (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) stores
    them as fp16 behind a Cast; one of K-quant parts alike (Q4_K, Q5_K, Q6_K) as the file's fp16 d
    times its int8 sub-block scales (Cast, Cast, Mul, Reshape; minimums alike); a fused matrix
    mixing the two (the products are neither) keeps float32 initializers, read by the
    DequantizeLinear directly. Each one's stored bytes are what the manifest says."""
    import onnx
    from onnx import TensorProto

    from edgekv.format.bundle import load_bundle
    from export.gguf_blocks import HALF_SCALES

    b = load_bundle(mixed_bundle[1])
    m = onnx.load(str(b.onnx_path), load_external_data=False)
    inits = {i.name: i for i in m.graph.initializer}
    made = {o: n for n in m.graph.node for o in n.output}
    size = lambda t: int(next(e.value for e in t.external_data if e.key == "length")) if t.external_data else len(t.raw_data)  # noqa: E731
    kinds = {"half": 0, "factored": 0, "float32": 0}
    for name, rec in b.manifest["weights"]["matrices"].items():
        if name == "embed.weight":  # the table's lookup: no DequantizeLinear of its own
            continue
        parts, base = set(rec["source"].split("|")), name.replace(".", "_")
        scale = made[base + "_dq"].input[1]
        if parts <= HALF_SCALES:
            cast, kind = made[scale], "half"
            assert cast.op_type == "Cast" and inits[cast.input[0]].data_type == TensorProto.FLOAT16, name
        elif parts <= {"Q4_K", "Q5_K", "Q6_K"} and len(parts) == 1:
            kind = "factored"
            reshape = made[scale]
            mul = made[reshape.input[0]]
            assert reshape.op_type == "Reshape" and mul.op_type == "Mul", name
            assert sorted(inits[made[i].input[0]].data_type for i in mul.input) == [TensorProto.INT8, TensorProto.FLOAT16]
        else:
            kind = "float32"
            assert scale not in made and inits[scale].data_type == TensorProto.FLOAT, name
        assert ("fp16 scales" in rec["carried"]) == (kind == "half"), name
        assert ("fp16 d times integer sc" in rec["carried"]) == (kind == "factored"), name
        stored = [t for t in inits.values() if t.name.startswith(base + "_") and t.name.endswith(
            ("_q", "_q_lo", "_q_hi", "_scale", "_f16", "_min", "_scale_d", "_scale_sc", "_min_d", "_min_sc"))]
        assert sum(size(t) for t in stored) == rec["bytes"], name
        kinds[kind] += 1
    # half: layer 0 q|k|v (Q5_0|Q5_0|Q8_0), layer 1 o (Q5_1) and down (Q4_1); float32: layer 1 q|k|v (Q4_K|Q4_0|Q4_1)
    assert kinds == {"half": 3, "factored": 5, "float32": 1}


def test_mixed_file_fuses_and_passes_tensorrt_rules(mixed_bundle, monkeypatch, tmp_path):
    """onnxruntime runs every projection and the head as MatMulNBits (none dequantized per call,
    no float table), and the graph the engine build hands TensorRT (fp16 scales widened, then the
    per-channel rewrite) passes every parser rule."""
    import onnx

    from edgekv.format.bundle import load_bundle
    from edgekv.graph.passes.trt_staging import widen_half_scales
    from edgekv.runtime.backends.engines import tensorrt_graph
    from edgekv.format.trt_rules import check_model
    from tests.test_weights import optimized_ops

    ops = optimized_ops(mixed_bundle[1], monkeypatch, tmp_path)
    assert ops["MatMulNBits"] == 2 * 4 + 1 and ops["float tables"] == 0
    b = load_bundle(mixed_bundle[1])
    m = onnx.load(str(b.onnx_path))
    assert widen_half_scales(m, b.onnx_path.parent)
    converted = tensorrt_graph(m, b.onnx_path.parent)  # the INT8 blocks (here 5 of the 9) go per channel
    assert len(converted) == 5 and check_model(m, "10.3") == []


def test_bare_graph_names_each_stored_form_once(mixed_bundle):
    """check-trt of the bare model.onnx (no staging): each packed code tensor and factored scale is
    one line naming the staging, none of their bit-operation nodes or UINT8 values is reported
    on its own, and the bundle check (the staged graph) has no violation at all."""
    from edgekv.format.bundle import load_bundle
    from edgekv.format.trt_rules import check_as_built, check_model
    from edgekv.runtime.backends.engines import tensorrt_graph

    b = load_bundle(mixed_bundle[1])
    violations = check_model(b.onnx_path, "10.3")
    forms = {v.node for v in violations if v.op == "form"}
    mats = b.manifest["weights"]["matrices"]
    packed = {n.replace(".", "_") + "_q" for n, r in mats.items() if "-bit codes" in r["carried"]}
    factored = {n.replace(".", "_") + s for n, r in mats.items() if "integer sc" in r["carried"]
                for s in ("_scale", "_min") if s == "_scale" or "scales and minimums" in r["carried"]}
    assert packed and factored and forms == packed | factored
    assert not [v for v in violations if v.op in ("BitShift", "BitwiseAnd", "BitwiseOr", "tensor")]
    assert check_as_built(b.onnx_path, "10.3", tensorrt_graph)[0] == []


def test_forms_handed_at_load_are_what_onnxruntime_computes_of_them(mixed_bundle):
    """The runtime unpacks the bundle's weight forms itself (edgekv/runtime/backends/forms.py, onnx's
    reference evaluator) and hands them to the session by name: each value = onnxruntime running
    that form's own nodes, bit for bit (type and shape too); none of the forms' nodes is left in
    the graph the session gets, and every form check-trt names is handed."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    from edgekv.format.bundle import load_bundle
    from edgekv.format.trt_rules import check_model
    from edgekv.graph.index import cone
    from edgekv.graph.passes.weight_forms import unpack_forms

    b = load_bundle(mixed_bundle[1])
    m = onnx.load(str(b.onnx_path))
    unpacked, handed = unpack_forms(m.SerializeToString(), str(b.onnx_path.parent))
    forms = {v.node for v in check_model(b.onnx_path, "10.3") if v.op == "form"}
    assert forms and {n for n, _ in handed.buffers} == forms
    left = {n.op_type for n in onnx.load_from_string(unpacked).graph.node}
    assert not {"BitShift", "BitwiseAnd", "BitwiseOr"} & left
    inits = {i.name: i for i in m.graph.initializer}
    made = {o: n for n in m.graph.node for o in n.output}
    for name, value in handed.buffers:
        nodes = cone(name, made, inits)
        g = helper.make_graph(nodes, "form", [], [helper.make_tensor_value_info(
                                  name, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape))],
                              [inits[i] for i in dict.fromkeys(i for n in nodes for i in n.input) if i in inits])
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        got = ort.InferenceSession(helper.make_model(g, opset_imports=list(m.opset_import)).SerializeToString(), opts,
                                   providers=["CPUExecutionProvider"]).run(None, {})[0]
        assert got.dtype == value.dtype and got.shape == value.shape, name
        np.testing.assert_array_equal(got, value, err_msg=name)
