"""Gemma 3 text through the fused graph (docs/fused.md, "Architectures"; issue 24 item 5): its
sliding-window layers read their own bias, `attention_bias.local` (local_key_mask as 0 / -inf,
in both call shapes: appended in place and moved to the spare slots), the query gain
(query_pre_attn_scalar) is the op's `scale`, the local layers' RoPE base their own tables. The
bundle's plain graph on ort-cpu is the oracle, as in tests/test_fused.py. The tiny checkpoint's
window is 8 (tests/archs.py): every call sequence here runs past it. Also: the fused load line
names EDGEKV_ATTENTION=plain as the way out only where that variable chose the attention."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from edgekv.format.bundle import LOCAL_MASK, load_bundle  # noqa: E402
from edgekv.graph.passes.fused_match import BIAS_LOCAL  # noqa: E402
from edgekv.runtime.backends.fused import ATTENTION_ENV  # noqa: E402
from edgekv.runtime.backends.ort import OrtBackend  # noqa: E402
from edgekv.runtime.batching import Batcher, Request  # noqa: E402
from edgekv.runtime.cache import KVCache  # noqa: E402
from test_fused import LOGITS_ATOL, Stream, float_kv_matches, needs_gqa, run_cells_match, optimized_graph, static_int8_clean_prompts  # noqa: E402
from tests.archs import GEMMA_PARITY_STEPS  # noqa: E402
from tests.conftest import chat_engine  # noqa: E402

pytestmark = needs_gqa

CONTEXT, WINDOW, CAPACITY = 128, 8, 64
LOCAL = [True, True, False]  # tests/archs.py's gemma3: layer_types sliding, sliding, full
QUERY_PRE_ATTN_SCALAR = 24  # its config: the op's scale is 24 ** -0.5, not 1 / sqrt(head_dim 16)
CALLS = [12, 5] + [1] * 10  # a prefill past the window, a chunk after it, decode steps (27 positions)


@pytest.fixture(scope="module")
def bundles(arch_bundles):
    """kv -> the tiny Gemma 3 exported with it (conftest's arch_bundles, the float one shared with
    test_gemma3: parity over 32 decode steps past the window, and check-trt passed)."""
    return lambda kv: arch_bundles("gemma3", kv, CONTEXT, steps=GEMMA_PARITY_STEPS)


def assert_gemma_layers(backend):
    assert backend.fused is not None, backend.attention
    layers = backend.fused.layers
    assert [L.local for L in layers] == LOCAL
    assert [L.rotary for L in layers] == ["op"] * 3  # head_dim 16: the op rotates (a silent downgrade fails)
    assert all(L.scale == pytest.approx(QUERY_PRE_ATTN_SCALAR ** -0.5, rel=1e-6) for L in layers)


def test_fused_equals_plain_float_kv_past_the_window(bundles):
    """One stream: a prefill of 12 (every row), a chunk of 5 and 10 decode steps, all past the
    window of 8: the plain graph's logits to float tolerance, every cached K/V slot for slot."""
    b = load_bundle(bundles("float"))
    plain, fused = Stream(b, "plain"), Stream(b, "fused")
    assert_gemma_layers(fused.backend)
    float_kv_matches(b, plain, fused, CALLS)
    assert fused.seq.n > 3 * WINDOW


def test_fused_equals_plain_through_the_windowed_cache(bundles):
    """generate's way on each attention: the plain graph through the windowed cache (the local
    layers' ring of 7) and the fused graph over its full head-major cache (it keeps every
    position): the same greedy tokens and logits over a 12-token prompt in chunks of 5 and 30
    decode steps (positions to 42)."""
    from tests.stream_reference import Generator

    b = load_bundle(bundles("float"))
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 380, 12)]
    out = {}
    for attention in ("plain", "fused"):
        be = OrtBackend(b, threads=1, attention=attention)
        g = Generator(be, KVCache(b, CAPACITY, memory=be.memory, windowed=True), prefill_chunk=5)
        logits, toks, rows = g.prefill(prompt).copy(), [], []
        for _ in range(30):
            rows.append(logits)
            toks.append(int(np.argmax(logits)))
            logits = g.decode_step(toks[-1]).copy()
        out[attention] = (g.cache.local_ring, toks, np.stack(rows))
    assert out["plain"][0] == WINDOW - 1 and out["fused"][0] is None
    assert out["fused"][1] == out["plain"][1]
    np.testing.assert_allclose(out["fused"][2], out["plain"][2], atol=LOGITS_ATOL, rtol=0)


def random_window_call(rng, b, past, s, write):
    """An engine-like call with both masks: s new tokens at consecutive positions after a past
    whose cells hold random earlier positions (a pool's or a ring's, not in slot order); key_mask
    shows each token a random part of the past and the new block causally, the write run's cells
    inside the past masked; local_key_mask is key_mask's keys within the window by position."""
    start = int(rng.integers(WINDOW, 2 * CAPACITY))
    pos = start + np.arange(s)[None]
    cell_pos = rng.integers(max(0, start - 3 * WINDOW), start, past)  # each past cell's position
    mask = rng.random((1, s, past + s)) < 0.8
    mask[0, :, past:] &= np.tri(s, dtype=np.bool_)
    mask[0, np.arange(s), past + np.arange(s)] = True
    mask[0, :, write: min(write + s, past)] = False
    keys = np.concatenate([cell_pos, pos[0]])
    local = mask & ((pos[0][:, None] - keys[None, :]) < WINDOW)[None]
    assert (local != mask).any()  # the window hides some key the global layer sees
    return rng.integers(0, b.model["vocab_size"], (1, s)), pos, mask, local


def test_fused_run_cells_equals_plain(bundles):
    """The engine's calls (run_cells) with a local mask that is not slot order: appended in place
    and written inside or above the past (moved, at = capacity): the plain graph's logits and the
    same K/V in the same cells, the cells around them untouched."""
    b = load_bundle(bundles("float"))
    cases = [(20, 1, 20), (20, 4, 20), (30, 3, 5), (30, 1, 45), (CAPACITY, 5, CAPACITY - 9)]
    run_cells_match(b, cases, lambda rng, past, s, write: random_window_call(rng, b, past, s, write))


def test_chat_ring_wrapped_equals_plain(bundles):
    """Chat's way (the batcher, one held sequence, its ring of 20 cells with 4 sinks wrapped by
    70 tokens and a reply): the fused backend's logits = the plain graph's at every step. Once
    wrapped, every call writes inside the past (moved) and the window is by the cells' positions."""
    b = load_bundle(bundles("float"))
    out = {}
    for attention in ("plain", "fused"):
        e = chat_engine(OrtBackend(b, threads=1, attention=attention), b, 20, chunk=4)
        seq = e.hold()
        seq.enable_ring(4)
        prompt = [int(t) for t in np.random.default_rng(5).integers(3, 380, 70)]
        req = e.run(Request(prompt, 12, seq=seq, record_logits=True))
        assert seq.wrapped
        out[attention] = req
    assert out["fused"].out == out["plain"].out
    np.testing.assert_allclose(np.stack(out["fused"].logits), np.stack(out["plain"].logits), atol=LOGITS_ATOL, rtol=0)


def test_static_int8_same_codes_and_tokens_past_the_window(bundles):
    """tests/test_fused.py's int8 oracle (static_int8_clean_prompts) over a prompt of 6 and 10
    greedy steps: 16 positions, twice the window."""
    b = load_bundle(bundles("int8-static"))
    plain_b = OrtBackend(b, threads=1, attention="plain")
    fused_b = OrtBackend(b, threads=1, attention="fused")
    assert_gemma_layers(fused_b)
    prompt, steps = 6, 11
    assert prompt + steps - 1 == 2 * WINDOW  # the positions the oracle checks it filled
    assert static_int8_clean_prompts(b, plain_b, fused_b, range(16), prompt, steps) >= 4


def test_session_runs_one_gqa_per_layer(bundles, tmp_path, monkeypatch):
    """A silent fallback must fail: the static bundle runs fused unasked (auto); its session
    takes both biases and neither mask; the optimized graph has one GroupQueryAttention per layer
    (the local ones reading attention_bias.local, every one with the query gain's scale), no
    Softmax, no MatMul of two activations, and two RoPE table pairs (the local base's own)."""
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    b = load_bundle(bundles("int8-static"))
    backend = OrtBackend(b, threads=1)
    assert backend.attention.startswith("attention: fused"), backend.attention
    assert_gemma_layers(backend)
    inputs = {i.name for i in backend.session.get_inputs()}
    assert {"attention_bias", BIAS_LOCAL} <= inputs and not {"key_mask", LOCAL_MASK} & inputs
    g = optimized_graph(backend, b, tmp_path)
    gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == b.model["n_layers"]
    bias_of = {n.name: n.input[10] for n in gqa}
    assert [bias_of[f"fused.{i}.gqa"] == BIAS_LOCAL for i in range(3)] == LOCAL, bias_of
    scales = [onnx.helper.get_attribute_value(a) for n in gqa for a in n.attribute if a.name == "scale"]
    assert scales == pytest.approx([QUERY_PRE_ATTN_SCALAR ** -0.5] * 3, rel=1e-6)
    assert len({n.input[7] for n in gqa}) == 2  # cos tables: the global base and the local one
    assert "Softmax" not in [n.op_type for n in g.node]
    consts = {t.name for t in g.initializer} | {o for n in g.node if n.op_type in ("Constant", "DequantizeLinear")
                                                for o in n.output}
    assert not [n.name for n in g.node if n.op_type in ("MatMul", "FusedMatMul") and n.input[1] not in consts]


def test_serve_slots_follow_the_plain_cell_pool(bundles):
    """Serve's fused slots (run_slots: each slot's cell j holds position j, the window's bias
    built per entry) against the cell pool on the graph as written: two requests past the
    window, the second joining while the first decodes: the same greedy tokens, logits to float
    tolerance."""
    b = load_bundle(bundles("float"))
    fused_b = OrtBackend(b, threads=1, max_logits_rows=8, attention="fused")
    plain_b = OrtBackend(b, threads=1, max_logits_rows=8, attention="plain")
    slots = Batcher(fused_b, KVCache(b, CONTEXT, memory=fused_b.slot_memory(2)), parallel=2, prefill_chunk=8)
    pool = Batcher(plain_b, KVCache(b, CONTEXT, memory=plain_b.memory), parallel=2, prefill_chunk=8)
    got = {}
    for name, eng in (("slots", slots), ("pool", pool)):
        rng = np.random.default_rng(4)
        a = Request([int(t) for t in rng.integers(3, 380, 11)], 20, record_logits=True)
        c = Request([int(t) for t in rng.integers(3, 380, 19)], 14, record_logits=True)
        eng.submit(a)
        for _ in range(3):
            eng.step()
        eng.submit(c)
        for _ in range(200):
            if a.finish_reason and c.finish_reason:
                break
            eng.step()
        got[name] = (a, c)
    assert slots.cache.layout == "sequence-slots"
    for x, y in zip(got["slots"], got["pool"]):
        assert x.out == y.out
        np.testing.assert_allclose(np.stack(x.logits), np.stack(y.logits), atol=LOGITS_ATOL, rtol=0)


def test_the_load_line_names_the_variable_only_where_it_chose(bundles, monkeypatch):
    """EDGEKV_ATTENTION=plain is the way out the fused load line gives where that variable chose
    the attention (generate, bench: attention None); a caller that asked for one (serve, by
    --slots) ignores the variable, so its line does not name it (serve's own names --slots 0)."""
    from edgekv.serve.server import open_serve_runtime

    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    b = load_bundle(bundles("int8-static"))
    assert f"{ATTENTION_ENV}=plain" in OrtBackend(b, threads=1).attention
    asked = OrtBackend(b, threads=1, attention="auto")
    assert asked.fused is not None and ATTENTION_ENV not in asked.attention, asked.attention
    with open_serve_runtime(b.path, CONTEXT, "ort-cpu", 1, "auto") as rt:
        assert rt.backend.fused is not None and ATTENTION_ENV not in rt.backend.attention
