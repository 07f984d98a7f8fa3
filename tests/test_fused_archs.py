"""The fused graph (edgekv/runtime/backends/fused.py) on every architecture the exporter writes
(docs/fused.md, "Architectures"), the bundle's plain graph on ort-cpu the oracle as in
tests/test_fused.py: Qwen3's q/k norm before RoPE, SmolLM3's NoPE layers, Phi-4-mini's partial
rotary and Phi's LongRoPE (attention factor and factors in the graph's own tables), and Llama
3.2 / Qwen2.5's configs (llama3 scaling, tied embeddings, biases). Each layer is fused in the way
its shapes allow GroupQueryAttention's CPU kernel: the op rotates (head_dim and rotary dims
multiples of 16), or the graph's own RoPE stays before it (Phi-4-mini's tiny config: 12 rotary
dims), or no rotation (NoPE); the expected way per layer is data below, so a silent downgrade
fails. A layer the op cannot express keeps the whole graph as written, the load line naming it."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from edgekv.errors import BackendUnavailable  # noqa: E402
from edgekv.format.bundle import file_sha256, load_bundle  # noqa: E402
from edgekv.runtime.backends.fused import ATTENTION_ENV  # noqa: E402
from edgekv.runtime.backends.ort import OrtBackend  # noqa: E402
from edgekv.runtime.cache import KVCache  # noqa: E402
from test_fused import (CALLS, CAPACITY, Stream, float_kv_matches, needs_gqa, optimized_graph,  # noqa: E402
                        random_cells_call, run_cells_match, static_int8_clean_prompts)
from tests.stream_reference import new_sequence, run_stream  # noqa: E402

pytestmark = needs_gqa

# how each layer reaches the op (tests/archs.py's ARCHS, and VARIANTS: two with the real models'
# head shapes at a tiny size, where the op rotates): "op" rotates inside it, "graph" keeps the
# graph's RoPE before it, "none" has no RoPE; the q|k norm ("norm") means the op is fed the normed
# q|k, not the projection
EXPECTED = {
    "qwen3-d32": (["op", "op"], True),
    "smollm3": (["op", "op", "op", "none"], False),  # no_rope_layers: every 4th layer
    "phi4-mini": (["graph", "graph"], True),  # 12 rotary dims: the op's rotary takes multiples of 16
    "phi4-mini-d32": (["op", "op"], False),
    "phi3.5-mini": (["op", "op"], False),
    "llama3.2": (["op", "op"], False),
    "qwen2.5": (["op", "op"], False),
}
FLOAT = ["qwen3-d32", "smollm3", "phi4-mini", "phi4-mini-d32", "phi3.5-mini"]
STATIC = ["qwen3-d32", "smollm3", "phi4-mini", "phi3.5-mini",
          pytest.param("llama3.2", marks=pytest.mark.slow), pytest.param("qwen2.5", marks=pytest.mark.slow)]


def context_of(name):
    return 64 if name.startswith("phi") else 128  # LongRoPE: within the original context (tests/test_architectures.py)


@pytest.fixture(scope="module")
def bundles(arch_bundles):
    """(arch, kv, dtype) -> the tiny checkpoint exported so (conftest's arch_bundles: once per run;
    the exporter's parity check and check-trt passed)."""
    return lambda name, kv, dtype="float32": arch_bundles(name, kv, context_of(name), dtype=dtype)


def assert_layers_as_expected(backend, name):
    modes, normed = EXPECTED[name]
    assert backend.fused is not None, backend.attention
    assert [L.rotary for L in backend.fused.layers] == modes
    # fed the layer's own q|k (normed, or rotated by the graph) or the packed projection as it is
    assert [L.qk is not None for L in backend.fused.layers] == [normed or m == "graph" for m in modes]


@pytest.mark.parametrize("name", FLOAT)
def test_fused_equals_plain_float_kv(name, bundles):
    """A prefill of 6 (every row's logits), a chunk of 5 after it and 8 decode steps: the plain
    graph's logits to float tolerance, every cached K (after RoPE) and V slot for slot."""
    b = load_bundle(bundles(name, "float"))
    plain, fused = Stream(b, "plain"), Stream(b, "fused")
    assert_layers_as_expected(fused.backend, name)
    float_kv_matches(b, plain, fused, CALLS)


@pytest.mark.parametrize("name", ["qwen3-d32", "phi4-mini"])
def test_fused_run_cells_equals_plain(name, bundles):
    """The engine's calls (any mask, any positions, the write run inside or above the past) with
    the op's RoPE (qwen3-d32: it reads position_ids) and the graph's (phi4-mini): the plain graph's
    logits and the same K/V in the same cells, the cells around them untouched."""
    b = load_bundle(bundles(name, "float"))
    cases = [(0, 4, 0), (0, 1, 7), (20, 3, 20), (20, 3, 5), (CAPACITY, 5, CAPACITY - 9)]
    run_cells_match(b, cases, lambda rng, past, s, write: random_cells_call(rng, b, CAPACITY, past, s, write))


@pytest.mark.parametrize("name", STATIC)
def test_static_int8_same_codes_and_tokens(name, bundles):
    """tests/test_fused.py's int8 oracle (static_int8_clean_prompts) on each architecture. Short
    prompts: the calibrated scales put a clamp in most longer ones."""
    b = load_bundle(bundles(name, "int8-static"))
    plain_b = OrtBackend(b, threads=1, max_logits_rows=1, attention="plain")
    fused_b = OrtBackend(b, threads=1, max_logits_rows=1, attention="fused")
    assert_layers_as_expected(fused_b, name)
    assert static_int8_clean_prompts(b, plain_b, fused_b, range(48), 3, 4) >= 4  # the strict half ran


@pytest.mark.parametrize("name", ["qwen3-d32", "smollm3", "phi4-mini"])
def test_session_runs_one_gqa_per_layer(name, bundles, tmp_path, monkeypatch):
    """A silent fallback must fail: a static bundle of each architecture runs the fused graph
    unasked (auto), and that graph as onnxruntime optimizes it has one GroupQueryAttention per
    layer, no Softmax and no MatMul of two activations (queries by keys, weights by values)."""
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    b = load_bundle(bundles(name, "int8-static"))
    backend = OrtBackend(b, threads=1)
    assert backend.attention.startswith("attention: fused"), backend.attention
    inputs = {i.name for i in backend.session.get_inputs()}
    assert {"seqlens_k", "total_sequence_length", "attention_bias"} <= inputs and "key_mask" not in inputs
    g = optimized_graph(backend, b, tmp_path)
    ops = [n.op_type for n in g.node]
    assert ops.count("GroupQueryAttention") == b.model["n_layers"]
    assert "Softmax" not in ops
    consts = {t.name for t in g.initializer} | {o for n in g.node if n.op_type in ("Constant", "DequantizeLinear")
                                                for o in n.output}
    assert not [n.name for n in g.node if n.op_type in ("MatMul", "FusedMatMul") and n.input[1] not in consts]


def rewrite_bundle(src, dst, edit):
    """A copy of bundle `src` whose graph `edit(model)` changed, its manifest's sizes and hashes
    brought up to date (the bundle's own record of its files)."""
    shutil.copytree(src, dst)
    path = dst / "model.onnx"
    m = onnx.load(str(path))
    edit(m)
    onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)
    manifest = json.loads((dst / "edgekv.json").read_text())
    for name in ("model.onnx", "model.onnx.data"):
        manifest["files"]["sizes"][name] = (dst / name).stat().st_size
        manifest["files"]["sha256"][name] = file_sha256(dst / name)
    (dst / "edgekv.json").write_text(json.dumps(manifest))
    return dst


def negate_layer_rotation(layer: int):
    """Layer `layer`'s RoPE MatMul multiplies by -R (a rotation the op has no form for; the other
    layers keep the exporter's R)."""
    def edit(m):
        from onnx import numpy_helper as nh

        prod = {o: n for n in m.graph.node for o in n.output}
        n = prod[f"present.{layer}.key"]
        while n.op_type != "Split":
            n = prod[n.input[0]]
        add = prod[n.input[0]]
        mat = next(prod[x] for mul in add.input for x in prod[mul].input if x in prod and prod[x].op_type == "MatMul")
        rot = next(t for t in m.graph.initializer if t.name == mat.input[1])
        m.graph.initializer.append(nh.from_array(-nh.to_array(rot), "rot.negated"))
        mat.input[1] = "rot.negated"
    return edit


def test_a_layer_the_op_cannot_express_keeps_the_graph_as_written(bundles, tmp_path, monkeypatch):
    """One layer (1 of 2) whose rotation the op cannot do: auto runs the whole graph as written
    (one session cannot mix the op's cache layout with the plain one), the load line names the
    layer and why; fused asked for is one line naming it."""
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    b = load_bundle(rewrite_bundle(bundles("qwen3-d32", "int8-static"), tmp_path / "b", negate_layer_rotation(1)))
    backend = OrtBackend(b, threads=1)
    assert backend.fused is None
    assert "layer 1" in backend.attention and "rotate_half" in backend.attention, backend.attention
    assert "key_mask" in {i.name for i in backend.session.get_inputs()}
    with pytest.raises(BackendUnavailable, match="layer 1: RoPE's rotation"):
        OrtBackend(b, threads=1, attention="fused")


# --- float16 graphs (issue 24 item 4's graph side: the GPU bundles' dtype), on the CPU provider's
# float16 GroupQueryAttention kernel as the stand-in for CUDA's ---------------------------------

def run_calls(path, attention):
    """Every row's logits over CALLS (a prefill, a chunk, decode steps) through one stream."""
    b = load_bundle(path)
    st = Stream(b, attention)
    rng = np.random.default_rng(3)
    out = [st.run(rng.integers(0, b.model["vocab_size"], (1, s)), np.arange(s)[None])[0] for s in CALLS]
    return st, np.concatenate(out)


def test_float16_graph_fuses(bundles):
    """A float16 graph (float KV) fuses with the op's T float16: its logits are the plain float16
    graph's to within that graph's own float16 noise (its distance from the float32 bundle of the
    same weights, on the same calls), and the top token is the same where the plain graphs agree."""
    fused, got = run_calls(bundles("smollm3", "float", "float16"), "fused")
    assert_layers_as_expected(fused.backend, "smollm3")
    inits = {t.name: t.data_type for t in fused.backend.fused.model.graph.initializer}
    assert inits["fused.cos_cache"] == onnx.TensorProto.FLOAT16
    assert fused.cache.buffers["past.0.key"].dtype == np.float16
    _, plain16 = run_calls(bundles("smollm3", "float", "float16"), "plain")
    _, plain32 = run_calls(bundles("smollm3", "float"), "plain")
    noise = np.abs(plain16 - plain32).max()
    assert 0 < np.abs(got - plain16).max() <= noise
    agree = plain16.argmax(-1) == plain32.argmax(-1)
    assert np.array_equal(got.argmax(-1)[agree], plain16.argmax(-1)[agree])


def test_float16_graph_fuses_int8_static(bundles, tmp_path):
    """A float16 int8-static graph: one GroupQueryAttention per layer (T float16, int8 cache,
    float scales), and layer 0's codes within one step of the plain graph's (the plain graph
    divides by the scale in float16, the op in float32: a quotient near a rounding boundary may
    land on either side; and the -128 clamp)."""
    b = load_bundle(bundles("smollm3", "int8-static", "float16"))
    plain_b, fused_b = (OrtBackend(b, threads=1, max_logits_rows=1, attention=a) for a in ("plain", "fused"))
    assert_layers_as_expected(fused_b, "smollm3")
    inits = {t.name: t.data_type for t in fused_b.fused.model.graph.initializer}
    assert inits["fused.0.k_scale"] == onnx.TensorProto.FLOAT and inits["fused.cos_cache"] == onnx.TensorProto.FLOAT16
    assert [n.op_type for n in optimized_graph(fused_b, b, tmp_path).node].count("GroupQueryAttention") == b.model["n_layers"]
    for seed in range(4):
        plain, fused = (KVCache(b, CAPACITY, memory=be.memory) for be in (plain_b, fused_b))
        seqs = new_sequence(plain), new_sequence(fused)
        ids = np.random.default_rng(seed).integers(0, b.model["vocab_size"], (1, 6))
        for be, c, q in ((plain_b, plain, seqs[0]), (fused_b, fused, seqs[1])):
            run_stream(be, c, q, ids, np.array([[5]]))
            q.advance(ids[0])
        a, f = plain.read(6), fused.read(6)
        for kv in ("key", "value"):
            d = a[f"past.0.{kv}"].astype(np.int16) - f[f"past.0.{kv}"].astype(np.int16)
            assert np.abs(d).max() <= 1, f"seed {seed}: layer 0 {kv} codes more than one step apart"
