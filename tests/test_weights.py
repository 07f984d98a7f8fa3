"""Quantized weights (docs/weights.md). Oracles: HF transformers running the weights decoded
from the bundle's ONNX initializers by onnx's own unpacking (ONNX = the reference model on the
same weights); the gguf package's own quantizer and dequantizer (GGUF blocks kept exactly);
the optimized onnxruntime graph itself (the fused MatMulNBits kernel is really used)."""
from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper

from edgekv.errors import BundleError
from edgekv.format.bundle import load_bundle
from edgekv.runtime.assemble import open_runtime
from edgekv.runtime.backends.engines import tensorrt_graph
from edgekv.graph.passes.trt_staging import widen_half_scales
from edgekv.graph.passes.trt_staging import fold_forms
from edgekv.format.trt_rules import check_model
from tests.conftest import make_hf_folder, optimized_graph
from tests.stream_reference import reference

CASES = [("llama", "int8"), ("llama", "int4"), ("qwen2", "int8"), ("qwen2", "int4")]


@pytest.fixture(scope="session")
def tiny_sources(tiny_llama, tiny_qwen):
    """conftest's tiny checkpoints (made once per run): a Llama, and a Qwen2 with tied embeddings."""
    return {"llama": tiny_llama, "qwen2": tiny_qwen}


@pytest.fixture(scope="session")
def weight_bundles(tiny_sources, tmp_path_factory):
    from export.pipeline import export_bundle

    root = tmp_path_factory.mktemp("wb")
    return {(arch, w): export_bundle(str(tiny_sources[arch]), kv="float", out=str(root / f"{arch}-{w}"),
                                     max_context=128, steps=4, weights=w)
            for arch, w in CASES}


def decoded_weights(onnx_path) -> dict[str, np.ndarray]:
    """Our weight name -> W [N, K] float64, decoded from the graph's integer initializers (of the
    file at `onnx_path`, or of a ModelProto with its weights)."""
    m = onnx_path if isinstance(onnx_path, onnx.ModelProto) else onnx.load(str(onnx_path))
    widen_half_scales(m, "")  # fp16 scales behind their Casts: as the runtime's pre-pass reads them (weights loaded)
    fold_forms(m, "")  # 5/6-bit codes packed: unpacked by onnx's reference evaluator running the graph's own nodes
    inits = {i.name: i for i in m.graph.initializer}
    arr = lambda n: numpy_helper.to_array(inits[n]).astype(np.float64)  # noqa: E731
    out = {}
    for node in m.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] not in inits or not node.input[0].endswith("_q"):
            continue
        base = node.input[0][:-2]
        codes, scale = arr(node.input[0]), arr(node.input[1])
        block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
        if block:  # [K, N] codes, [K/B, N] scales; W = (codes + shift) * scale + min
            shift = float(arr(base + "_shift")) if base + "_shift" in inits else 0.0
            wt = (codes + shift) * np.repeat(scale, block, axis=0)
            if base + "_min" in inits:
                wt = wt + np.repeat(arr(base + "_min"), block, axis=0)
        else:  # per output channel: scales [N] along axis 1
            wt = codes * scale[None, :]
        out[_name(base)] = wt.T
    shared = [n for n in m.graph.node if n.name.endswith("_table_to_rows")]
    if shared:  # a tied table read from the head's initializers: the lookup subgraph run on every id
        out["embed.weight"] = table_lookup(m, shared[0].output[0], codes_shape(inits, shared[0]))
    if "embed_weight_q" in inits:  # the Gather's table: rows times their (block) scales
        codes, scale = arr("embed_weight_q"), arr("embed_weight_scale")  # [V, E] & [V, 1] or [V, E/B, B] & [V, E/B, 1]
        rows = codes * scale + (arr("embed_weight_min") if "embed_weight_min" in inits else 0.0)
        out["embed.weight"] = rows.reshape(codes.shape[0], -1)
    return out


def codes_shape(inits, node) -> tuple[int, int]:
    """[K, V] of the head's codes a shared table lookup reads."""
    k, v = inits[node.name[: -len("_table_to_rows")] + "_q"].dims
    return int(k), int(v)


def table_lookup(m: onnx.ModelProto, out: str, kv: tuple[int, int]) -> np.ndarray:
    """The embedding rows [V, K] the graph's own lookup nodes compute for ids 0..V-1 (onnxruntime
    running only the nodes `out` depends on)."""
    import onnxruntime as ort

    k, v = kv
    producers = {o: n for n in m.graph.node for o in n.output}
    inits = {i.name: i for i in m.graph.initializer}
    need, todo, used = [], [out], set()
    while todo:
        t = todo.pop()
        if t in producers and producers[t].name not in used:
            used.add(producers[t].name)
            need.append(producers[t])
            todo.extend(producers[t].input)
    need.sort(key=lambda n: list(m.graph.node).index(n))
    ids = next(i for i in m.graph.input if i.name == "input_ids")
    names = {i for n in need for i in n.input}
    g = onnx.helper.make_graph(need, "lookup", [ids], [onnx.helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
                               [inits[n] for n in names if n in inits])
    sub = onnx.helper.make_model(g, opset_imports=list(m.opset_import), ir_version=m.ir_version)
    s = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"input_ids": np.arange(v, dtype=np.int64)[None]})[0][0].astype(np.float64)


def graph_norms(onnx_path) -> dict[str, np.ndarray]:
    """The RMSNorm weights the graph holds (AWQ folds its input scales into them), by our names."""
    m = onnx.load(str(onnx_path))
    return {i.name: numpy_helper.to_array(i).astype(np.float64) for i in m.graph.initializer
            if i.name.endswith("norm.weight")}


def _name(base: str) -> str:
    for a, b in (("layers_", "layers."), ("_attn_", ".attn."), ("_mlp_", ".mlp."), ("_weight", ".weight"),
                 ("lm_head", "lm_head"), ("embed", "embed")):
        base = base.replace(a, b)
    return base


def hf_logits(folder, weights: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """transformers' model with the given weights (by our names) in place of the checkpoint's."""
    import transformers

    from export.checkpoint_names import unfuse
    from export.loaders import load_hf_folder

    src = load_hf_folder(folder)
    sd = dict(src.state_dict)
    sd.update({k: torch.from_numpy(v).float() for k, v in weights.items()})
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, tie_word_embeddings=False,
                                                              torch_dtype=torch.float32).eval()
    hf_sd = unfuse(sd, src.config)
    hf_sd.setdefault("lm_head.weight", sd.get("lm_head.weight", sd["embed.weight"]))
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def ort_logits(bundle, ids: list[int], accuracy: int = 0) -> np.ndarray:
    with open_runtime(bundle, 64, "ort-cpu", threads=1, max_logits_rows=len(ids), log=None,
                      matmul_accuracy=accuracy) as rt:
        gen = reference(rt, prefill_chunk=len(ids))
        return np.stack([gen.prefill(ids[: i + 1]).copy() if i == 0 else _step(gen, t) for i, t in enumerate(ids)])


def _step(gen, tok):
    return gen.decode_step(tok).copy()


@pytest.mark.parametrize("arch,fmt", CASES)
def test_onnx_equals_transformers_on_the_bundles_weights(arch, fmt, tiny_sources, weight_bundles):
    b = weight_bundles[(arch, fmt)]
    w = decoded_weights(load_bundle(b).onnx_path)
    n_proj = 4 * 2  # wqkv, wo, w_gate_up, w_down in 2 layers
    assert len([k for k in w if k.startswith("layers.")]) == n_proj and "lm_head.weight" in w and "embed.weight" in w
    ids = [5, 17, 99, 3, 250, 42, 7, 300]
    norms = graph_norms(load_bundle(b).onnx_path)
    assert len(norms) == 2 * 2 + 1
    ref = hf_logits(tiny_sources[arch], {**w, **norms}, ids)
    got = ort_logits(b, ids)
    np.testing.assert_allclose(got, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)
    # the stored weights really are quantized: not the float checkpoint's values
    from export.loaders import load_hf_folder

    name = "layers.0.attn.wo.weight"  # a matrix AWQ leaves unscaled (export/awq.py)
    orig = load_hf_folder(tiny_sources[arch]).state_dict[name].numpy()
    err = np.abs(w[name] - orig).max() / np.abs(orig).max()
    assert (1e-3 if fmt == "int8" else 1e-2) < err < (1e-2 if fmt == "int8" else 0.2)
    levels = len(np.unique(np.round(w[name][0] / np.abs(w[name][0]).max(), 6)))
    assert levels <= (255 if fmt == "int8" else 16) * (64 // 32)


@pytest.mark.parametrize("arch,fmt", CASES)
def test_graph_format_opset_and_trt_rules(arch, fmt, weight_bundles):
    b = load_bundle(weight_bundles[(arch, fmt)])
    assert b.weights == fmt and b.manifest["format_version"] == 2
    m = onnx.load(str(b.onnx_path), load_external_data=False)
    opset = lambda: next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx"))  # noqa: E731
    assert opset() == 21  # block-wise DequantizeLinear (INT4, and the 8-bit blocks) needs it
    types = collections.Counter(i.data_type for i in m.graph.initializer)
    assert types[TensorProto.INT4] == (8 if fmt == "int4" else 0)
    assert not any(i.data_type == TensorProto.FLOAT and len(i.dims) == 2 and min(i.dims) >= 64
                   for i in m.graph.initializer), "a float weight matrix is left in the graph"
    # as stored, the 8-bit blocks break TensorRT's rule (block-wise DQ only for INT4): the head,
    # and for int8 every projection ...
    blocked8 = {v.node for v in check_model(m, "10.3") if "block-wise DequantizeLinear of INT8" in v.rule}
    assert len(blocked8) == (1 if fmt == "int4" else 2 * 4 + 1)
    # ... and the graph the engine build hands TensorRT passes every rule, at opset 20 without INT4
    converted = tensorrt_graph(m, b.onnx_path.parent)
    assert len(converted) == len(blocked8) and check_model(m, "10.3") == []
    assert opset() == (21 if fmt == "int4" else 20)


def optimized_ops(bundle, monkeypatch, tmp_path) -> collections.Counter:
    """The op types of the graph onnxruntime really runs, as the runtime's own backend builds it."""
    g = optimized_graph(bundle, monkeypatch, tmp_path)
    ops = collections.Counter(n.op_type for n in g.node)
    # a float copy of the embedding table (DequantizeLinear folded at load) would show up here
    ops["float tables"] = sum(i.data_type == TensorProto.FLOAT and np.prod(i.dims) >= 384 * 64 for i in g.initializer)
    return ops


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fused_low_bit_kernel_is_used(fmt, weight_bundles, monkeypatch, tmp_path):
    ops = optimized_ops(weight_bundles[("llama", fmt)], monkeypatch, tmp_path)
    assert ops["MatMulNBits"] == 2 * 4 + 1  # every projection and the head: none dequantized per call
    assert ops["DequantizeLinear"] == 1  # only the embedding's gathered rows (unit scale)
    assert ops["float tables"] == 0


def test_runtime_default_int8_activations_stay_close(weight_bundles):
    """The runtime runs MatMulNBits with int8 activations (accuracy level 4, llama.cpp's choice):
    close to the float-activation result the parity check holds to torch."""
    b = weight_bundles[("llama", "int4")]
    ids = [5, 17, 99, 3, 250, 42, 7, 300]
    exact, fast = ort_logits(b, ids, 0), ort_logits(b, ids, 4)
    assert 0 < np.abs(exact - fast).max() < 0.05 * np.abs(exact).max()


# --- GGUF blocks ---------------------------------------------------------------------------

def _gguf_types(name: str):
    import gguf

    T = gguf.GGMLQuantizationType
    if name.startswith(("token_embd", "output.")):
        return T.Q8_0
    return T.Q4_0 if "attn" in name else T.Q4_1


@pytest.fixture(scope="session")
def gguf_bundle(tiny_sources, tmp_path_factory):
    from export.pipeline import export_bundle
    from tests.test_gguf import write_gguf

    root = tmp_path_factory.mktemp("wgguf")
    path = root / "tiny-q.gguf"
    write_gguf(tiny_sources["llama"], path, quant=_gguf_types)  # untied, as conftest's tiny Llama
    return path, export_bundle(str(path), kv="float", out=str(root / "bundle"), max_context=128, steps=4,
                               weights="int4")


def test_gguf_blocks_reproduced_exactly(gguf_bundle):
    """Q4_0 (attention), Q4_1 (MLP), Q8_0 (embedding): the bundle's dequantized weights equal the
    gguf package's dequantization of the file bit for bit."""
    import gguf

    from tests.test_gguf_kquants import file_weights  # the one reader of a file's blocks (gguf's dequantize)

    path, bundle = gguf_bundle
    r = gguf.GGUFReader(str(path))
    kinds = collections.Counter(t.tensor_type.name for t in r.tensors if len(t.shape) == 2)
    assert kinds["Q4_0"] and kinds["Q4_1"] and kinds["Q8_0"]
    man = load_bundle(bundle).manifest
    ref = {k: v.astype(np.float64) for k, v in file_weights(path).items()}
    got = decoded_weights(load_bundle(bundle).onnx_path)
    assert set(got) == set(ref)
    for name in got:  # Q4_1's d and m kept apart (no float32 rounding of m + 8d): bit for bit too
        np.testing.assert_array_equal(got[name].astype(np.float32), ref[name].astype(np.float32), err_msg=name)
    stored = man["weights"]["stored"]
    assert {"gguf Q4_0", "gguf Q4_1", "gguf Q8_0"} <= set(stored)


def test_tied_head_is_the_tables_own_q8_0_blocks(tmp_path, monkeypatch):
    """A tied GGUF (no output.weight: SmolLM2's case) stores its head from the table's Q8_0 blocks
    as they are, not requantized, and only once: the lookup reads the head's initializers (also
    after the engine build's per-channel rewrite), and onnxruntime still fuses the head."""
    from export.pipeline import export_bundle
    from tests.test_gguf import write_gguf

    folder = make_hf_folder(tmp_path / "hf", "llama", tie_word_embeddings=True)
    write_gguf(folder, tmp_path / "tied.gguf", quant=_gguf_types)
    b = load_bundle(export_bundle(str(tmp_path / "tied.gguf"), kv="float", out=str(tmp_path / "b"), max_context=64,
                                  steps=2, weights="int4"))
    got = decoded_weights(b.onnx_path)
    np.testing.assert_array_equal(got["lm_head.weight"], got["embed.weight"])
    assert b.manifest["weights"]["stored"]["gguf Q8_0"]["tensors"] == 2
    # stored once: the lookup's table is the head's very bytes in the weights file
    m = onnx.load(str(b.onnx_path), load_external_data=False)
    where = {i.name: {e.key: e.value for e in i.external_data} for i in m.graph.initializer if i.external_data}
    assert where["lm_head_weight_table_q"] == where["lm_head_weight_q"]
    assert where["lm_head_weight_table_scale_f16"] == where["lm_head_weight_scale_f16"]
    regions = {(int(w.get("offset", 0)), int(w["length"])) for w in where.values()}
    assert (b.onnx_path.parent / "model.onnx.data").stat().st_size == sum(ln for _, ln in regions)
    q = b.manifest["weights"]["matrices"]
    assert q["lm_head.weight"]["bytes"] == 0 and q["embed.weight"]["bytes"] > 0
    # the engine build's per-channel head leaves the table's own copy as stored; every rule passes
    m = onnx.load(str(b.onnx_path))
    tensorrt_graph(m, b.onnx_path.parent)
    np.testing.assert_array_equal(decoded_weights(m)["embed.weight"], got["embed.weight"])
    assert check_model(m, "10.3") == []
    ops = optimized_ops(b.onnx_path.parent, monkeypatch, tmp_path)
    assert ops["MatMulNBits"] == 2 * 4 + 1 and ops["float tables"] == 0


def test_tensorrt_gets_the_q8_0_head_per_channel(gguf_bundle):
    """TensorRT takes no INT8 blocks: the engine build's graph holds the head per output channel,
    within half a per-channel step of the Q8_0 values; the INT4 projections and the table as stored."""
    path, bundle = gguf_bundle
    b = load_bundle(bundle)
    m = onnx.load(str(b.onnx_path))
    stored = decoded_weights(m)
    assert tensorrt_graph(m, b.onnx_path.parent) == ["lm_head_weight_q"]
    got = decoded_weights(m)
    head, q8 = got["lm_head.weight"], stored["lm_head.weight"]
    step = np.abs(q8).max(1, keepdims=True) / 127
    assert 0 < np.abs(head - q8).max() and np.all(np.abs(head - q8) <= step / 2 + 1e-7)
    for name in set(got) - {"lm_head.weight"}:
        np.testing.assert_array_equal(got[name], stored[name], err_msg=name)


def test_gguf_int4_bundle_matches_torch_and_fuses(gguf_bundle, monkeypatch, tmp_path):
    path, bundle = gguf_bundle
    man = load_bundle(bundle).manifest
    assert man["parity"]["passed"] and man["parity"]["outputs"]["logits (decode)"]["max_abs_diff"] < 1e-3
    ops = optimized_ops(bundle, monkeypatch, tmp_path)
    assert ops["MatMulNBits"] == 2 * 4 + 1


def greedy_logits(bundle, attention: str, accuracy: int = 0, steps: int = 6) -> tuple[np.ndarray, list[int]]:
    """Logits of a prompt's every row and of `steps` greedy decode steps after it, and the tokens."""
    ids = [5, 17, 99, 3, 250, 42, 7, 300]
    with open_runtime(bundle, 64, "ort-cpu", threads=1, max_logits_rows=len(ids), log=None,
                      matmul_accuracy=accuracy, attention=attention) as rt:
        gen = reference(rt, prefill_chunk=len(ids))
        rows = [np.atleast_2d(gen.prefill(ids, all_logits=True).copy())]
        tokens = [int(rows[0][-1].argmax())]
        for _ in range(steps):
            rows.append(np.atleast_2d(gen.decode_step(tokens[-1]).copy()))
            tokens.append(int(rows[-1][-1].argmax()))
    return np.concatenate([r.reshape(-1, r.shape[-1]) for r in rows]), tokens


@pytest.mark.parametrize("attention", ["plain", "fused"])
def test_gguf_minimums_run_as_matmulnbits_zero_points(attention, gguf_bundle, monkeypatch, tmp_path):
    """At load each Q4_1 matrix (DQ -> MatMul + its minimum term) becomes one MatMulNBits whose zero
    points carry the minimum (edgekv/runtime/backends/nbits.py), in the graph as written and in the
    fused one: the session onnxruntime runs holds a MatMulNBits with uint8 zero points per Q4_1
    matrix and only the remainder's [K/32, N] MatMul beside it (a silent fallback keeps the old
    [2K/32, N] term and fails); with float activations the logits are the graph as written's to float
    tolerance and the greedy tokens the same."""
    from edgekv.runtime.backends.ort import OrtBackend

    path, bundle = gguf_bundle
    b = load_bundle(bundle)
    q41 = [n for n, v in b.manifest["weights"]["matrices"].items() if v["source"] == "Q4_1"]
    with open_runtime(bundle, 64, "ort-cpu", threads=1, log=None, attention=attention) as rt:
        assert rt.backend.minimums.folded == len(q41) == 2 * 2 and not rt.backend.minimums.kept
    g = optimized_graph(bundle, monkeypatch, tmp_path, attention)
    inits = {t.name: t for t in g.initializer}
    nbits = [n for n in g.node if n.op_type == "MatMulNBits"]
    with_zp = [n for n in nbits if len(n.input) > 3 and n.input[3]]
    assert len(nbits) == 2 * 4 + 1 and len(with_zp) == len(q41)
    assert all(inits[n.input[3]].data_type == TensorProto.UINT8 for n in with_zp)
    # blocksum(x), what a minimum term multiplies: nbits' one MatMul by the shared block indicator
    sums = {n.output[0] for n in g.node if n.op_type == "MatMul" and n.input[1].startswith("edgekv/blocksum_")}
    terms = [list(inits[n.input[1]].dims) for n in g.node if n.op_type == "MatMul" and n.input[0] in sums]
    e, f = b.model["hidden_size"], b.model["intermediate_size"]
    assert sorted(terms) == sorted([[e // 32, 2 * f], [f // 32, e]] * 2)  # gate|up and down: K/32 rows each
    new, new_tokens = greedy_logits(bundle, attention)
    monkeypatch.setattr(OrtBackend, "fold_minimums", False)
    old, old_tokens = greedy_logits(bundle, attention)
    np.testing.assert_allclose(new, old, rtol=0, atol=1e-4)
    assert new_tokens == old_tokens


def test_bad_weight_flags_refused(tiny_sources):
    from tests.conftest import run_edgekv

    r = run_edgekv("export", tiny_sources["llama"], "--weights", "int4", "--group", "128", "--out", "/tmp/never")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "--group 128 does not divide" in r.stderr


def test_unknown_weight_format_refused(weight_bundles, tmp_path):
    import shutil

    b = tmp_path / "b"
    shutil.copytree(weight_bundles[("llama", "int8")], b)
    m = json.loads((b / "edgekv.json").read_text())
    m["weights"]["format"] = "int3"
    (b / "edgekv.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="weights.format is 'int3', not one of float, int8, int4"):
        load_bundle(b)


@pytest.mark.slow
def test_real_model_own_4bit_weights_answers_paris(real_bundle_int4):
    """The default model exported with its GGUF's own Q4_1 blocks (--weights int4: conftest's
    real_bundle_int4, the run's one export of it)."""
    b = load_bundle(real_bundle_int4)
    assert {"gguf Q4_1"} <= set(b.manifest["weights"]["stored"])
    with open_runtime(b, 256, "ort-cpu", log=None) as rt:
        codec, gen = rt.codec, reference(rt)
        ids = codec.chat_ids([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
        out = [int(np.argmax(gen.prefill(ids)))]
        for _ in range(12):
            out.append(int(np.argmax(gen.decode_step(out[-1]))))
    assert "Paris" in codec.decode(out)


def test_eval_reference_is_float_weights_and_shows_total_memory(weight_bundles, tiny_bundle_float):
    import io

    from edgekv.tools.evaluate import evaluate

    float_b = tiny_bundle_float  # the same tiny Llama, float weights and KV (conftest's, shared)
    quant_b = weight_bundles[("llama", "int4")]
    res = evaluate([str(quant_b), str(float_b)], ctx=32, chunks=2, threads=1, out=io.StringIO())
    assert res["reference"] == float_b.name  # listed second, chosen for its float weights
    rows = {r["weights"]: r for r in res["results"]}
    assert rows["float"]["kld_mean"] == 0 and rows["int4"]["kld_mean"] > 0
    for fmt, b in (("float", float_b), ("int4", quant_b)):
        disk = sum(f.stat().st_size for f in b.glob("model.onnx*"))
        kv = load_bundle(b).kv_bytes_per_token() * 32
        assert rows[fmt]["total_mib_at_ctx"] == pytest.approx((disk + kv) / 2**20)
    assert rows["int4"]["weights_mib"] < 0.6 * rows["float"]["weights_mib"]


def test_int4_weights_with_int8_cache_load_and_match_torch(tiny_sources, tmp_path):
    """INT4 weights (opset 21) with the int8 KV cache's Q/DQ: the graph loads in the ORT backend
    and the exporter's parity check (ONNX vs torch) passes (onnxruntime's QDQ propagation broke
    the load; docs/weights.md)."""
    from export.pipeline import export_bundle

    b = load_bundle(export_bundle(str(tiny_sources["qwen2"]), kv="int8", out=str(tmp_path / "b"), max_context=128,
                                  steps=2, weights="int4"))
    assert b.weights == "int4" and b.manifest["parity"]["passed"]
    with open_runtime(b, 64, "ort-cpu", log=None) as rt:
        logits = reference(rt).prefill(list(range(1, 9)))
    assert np.isfinite(logits).all()


def test_engine_build_parses_the_per_channel_graph(gguf_bundle, monkeypatch, tmp_path):
    """build-engine against the TensorRT stand-in (whose parser refuses what check-trt refuses):
    the stored graph is refused, the engine is built from its per-channel rewrite, leaves no
    scratch file, and runs within the head's requantization of onnxruntime on the stored graph."""
    import shutil

    from edgekv.runtime.backends import OrtBackend, make_backend
    from edgekv.runtime.cache import KVCache
    from tests.stream_reference import Generator
    from tests import fake_gpu

    trt, _ = fake_gpu.install(monkeypatch)
    from jetson.build_engine import build_engine

    b = tmp_path / "b"
    shutil.copytree(gguf_bundle[1], b)
    parser = trt.OnnxParser(trt.Builder(None).create_network(1 << 5), None)
    assert not parser.parse_from_file(str(b / "model.onnx"))
    assert any("block-wise DequantizeLinear of INT8" in parser.get_error(i) for i in range(parser.num_errors))
    folder = build_engine(str(b), ctx=64, max_prefill=16)
    assert not list(folder.parent.glob(".*")) and sorted(p.name for p in folder.iterdir()) == ["engine.json", "model.plan"]
    bundle = load_bundle(b)
    be = make_backend("trt", bundle, ctx=64, max_logits_rows=16)
    seq = [5, 17, 99, 3, 250, 42, 7, 300]
    got = Generator(be, KVCache(bundle, 64, memory=be.memory)).prefill(seq).copy()
    be.close()
    ref = Generator(OrtBackend(bundle, threads=1, past_bucket=1), KVCache(bundle, 64), prefill_chunk=16).prefill(seq)
    assert 0 < np.abs(got - ref).max() < 0.02 * np.abs(ref).max()


def test_8bit_blocks_need_k_in_multiples_of_32():
    """A matrix whose input size is not a multiple of 32 gets one INT8 scale per output channel
    instead of blocks (a head or int8 projection of any width still exports)."""
    from export.weights import plan_weights

    rng = np.random.default_rng(0)
    state = {"a.weight": rng.standard_normal((48, 64)).astype(np.float32),
             "b.weight": rng.standard_normal((48, 40)).astype(np.float32),
             "embed.weight": rng.standard_normal((100, 40)).astype(np.float32),
             "lm_head.weight": rng.standard_normal((100, 40)).astype(np.float32)}
    plan = plan_weights(state, {}, "int8", 32, "embed.weight", "lm_head.weight")
    assert plan["a.weight"].block == 32 and plan["b.weight"].block is None and plan["lm_head.weight"].block is None
    for name in ("a.weight", "b.weight", "lm_head.weight"):
        w, q = state[name], plan[name].dequantize()
        assert np.abs(q - w).max() <= np.abs(w).max() / 254 + 1e-6, name
