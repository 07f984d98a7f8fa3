"""Temperature 0 is a function of the prompt alone (issue 22, item 4): a sequence's logits do not
depend on the other sequences decoded beside it, on the row it gets in the call, on where its cells
lie in the pool or on whether its prefix was cached. The oracle is the sequence decoded alone in
its own cache (Generator), compared bit for bit: every sum the attention makes is exact (ort.py,
ExactAttention), so there is no tolerance to choose. On the real int4-weights bundle (the
quickstart's) an ulp of difference became a different greedy token within a few steps."""
from __future__ import annotations

import numpy as np
import pytest

from edgekv.runtime.assemble import open_runtime
from edgekv.runtime.batching import Request
from tests.test_serve_engine import alone, batch_schedule, run_until_done

QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello in German."]
STEPS = 16


def assert_same(got_toks, got_rows, want_toks, want_rows, what):
    assert got_toks == want_toks, what
    for i, (g, w) in enumerate(zip(got_rows, want_rows)):
        assert np.array_equal(g, w), f"{what}: logits of step {i} differ by up to {np.abs(g - w).max():.3g}"


# --- the tiny int8-KV bundle: fast, every CI run ---------------------------------------------

def test_the_tiny_bundles_attention_is_rewritten_exact(rt_int8, rt_float):
    assert rt_int8.backend.exact  # integer codes in the cache: exact sums
    assert not rt_float.backend.exact  # float values: left as written (docs/weights.md)


def test_tiny_int8_batched_equals_alone_bit_for_bit(rt_int8):
    """The serving engine's schedule (joining, mixed prefill and decode, leaving): every logit
    equals the lone decode's exactly, not within a tolerance."""
    engine = rt_int8.batcher(capacity=256, parallel=4, prefill_chunk=8)
    spec, reqs, _ = batch_schedule(engine)
    for k, (prompt, n) in spec.items():
        want_toks, want_rows = alone(rt_int8, prompt, n)
        assert_same(reqs[k].out, reqs[k].logits, want_toks, want_rows, k)


def test_exact_attention_computes_the_graphs_attention(tiny_bundle_int8):
    """The rewrite changes sums, not what is summed: against the graph as written the logits
    agree to float rounding (the tolerance is far below any wrong scale or dropped part)."""
    from edgekv.format.bundle import load_bundle
    from edgekv.runtime.backends.ort import OrtBackend
    from edgekv.runtime.cache import KVCache
    from tests.stream_reference import Generator

    b = load_bundle(tiny_bundle_int8)

    def logits(exact):
        be = OrtBackend(b, threads=1, exact=exact)
        assert be.exact == exact
        g = Generator(be, KVCache(b, 64, memory=be.memory), prefill_chunk=8)
        rows = [g.prefill(list(range(5, 30))).copy()]  # chunked: past and new parts both used
        return np.stack(rows + [g.decode_step(t).copy() for t in (7, 8, 9, 10)])

    got, want = logits(True), logits(False)
    assert not np.array_equal(got, want)  # the rewrite ran
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)


def test_edgekv_exact_0_runs_the_graph_as_written(tiny_bundle_int8, monkeypatch):
    monkeypatch.setenv("EDGEKV_EXACT", "0")
    with open_runtime(tiny_bundle_int8, ctx=64, backend="ort-cpu", threads=1) as rt:
        assert not rt.backend.exact
    monkeypatch.delenv("EDGEKV_EXACT")
    with open_runtime(tiny_bundle_int8, ctx=64, backend="ort-cpu", threads=1) as rt:
        assert rt.backend.exact


# --- the real int4-weights bundle --------------------------------------------------------------

@pytest.fixture(scope="module")
def rt4(real_bundle_int4):
    """The quickstart's bundle (the default model, its GGUF's own 4-bit blocks, --kv auto's int8
    cache), exported once per run when this exporter did not make the one there (conftest's
    real_export), on the graph as written: the shared cell pool's graph (serve --slots 0), whose
    sums ExactAttention makes exact. (Serve's default for a static int8 bundle, fused slots, is
    batched = alone by its own construction: the last test here.)"""
    rt = open_runtime(real_bundle_int4, ctx=512, backend="ort-cpu", attention="plain")
    assert rt.bundle.weights == "int4"
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def alone4(rt4):
    """alone() on rt4, each prompt decoded once per module (the oracle is a function of the
    prompt: two tests asking for the same prompt get the same lone decode)."""
    made = {}

    def get(prompt):
        if tuple(prompt) not in made:
            made[tuple(prompt)] = alone(rt4, prompt, STEPS)
        return made[tuple(prompt)]
    return get


def chat_prompts(rt, questions, system=None):
    head = [{"role": "system", "content": system}] if system else []
    return [rt.codec.chat_ids(head + [{"role": "user", "content": q}]) for q in questions]


@pytest.mark.slow
def test_int4_two_identical_requests_in_one_step_decode_identically(rt4, alone4):
    """Four pairs of identical requests, all eight in flight together: each pair's two rows (other
    cells, other rows of every call) give the same tokens and logits, and so does the prompt alone."""
    engine = rt4.batcher(capacity=512, parallel=8, prefill_chunk=16)
    pairs = [(Request(p, STEPS, record_logits=True), Request(p, STEPS, record_logits=True)) for p in chat_prompts(rt4, QUESTIONS)]
    for a, b in pairs:
        engine.submit(a), engine.submit(b)
    run_until_done(engine, [r for pair in pairs for r in pair])
    for (a, b), q in zip(pairs, QUESTIONS):
        assert_same(a.out, a.logits, b.out, b.logits, f"{q!r}: the pair")
        assert_same(a.out, a.logits, *alone4(a.prompt), f"{q!r}: the pair against alone")


@pytest.mark.slow
def test_int4_batched_equals_alone(rt4, alone4):
    """Four chat prompts joining two steps apart (mid-prefill or mid-decode of the others) give
    what each gives decoded alone."""
    engine = rt4.batcher(capacity=512, parallel=4, prefill_chunk=16)
    reqs = [Request(p, STEPS, record_logits=True) for p in chat_prompts(rt4, QUESTIONS)]
    for r in reqs:
        engine.submit(r)
        engine.step(), engine.step()
    run_until_done(engine, reqs)
    for r, q in zip(reqs, QUESTIONS):
        assert_same(r.out, r.logits, *alone4(r.prompt), repr(q))


@pytest.mark.slow
def test_int4_cached_prefix_equals_a_fresh_prefill(rt4, alone4):
    """A shared system prompt cached by the first request: each later request prefills only its
    own message and gives what a fresh prefill of its whole prompt gives."""
    system = "You are a helpful assistant who answers briefly and precisely, in plain English."
    prompts = chat_prompts(rt4, QUESTIONS, system)
    shared = next(i for i, (x, y) in enumerate(zip(prompts[0], prompts[1])) if x != y)
    engine = rt4.batcher(capacity=512, parallel=4, prefill_chunk=16)
    first = Request(prompts[0], 4)
    engine.submit(first)
    run_until_done(engine, [first])
    for p, q in zip(prompts[1:], QUESTIONS[1:]):
        r = Request(p, STEPS, record_logits=True)
        engine.submit(r)
        run_until_done(engine, [r])
        assert r.reused >= shared - 1, f"{q!r}: the system prompt was not reused"
        assert_same(r.out, r.logits, *alone4(p), repr(q))


@pytest.mark.slow
def test_int4_fused_slots_batched_equals_alone(real_bundle_int4):
    """What serve runs the quickstart's bundle on by default (fused slots: one GroupQueryAttention
    call per layer over the slots in use): four chat prompts joining two steps apart give, bit for
    bit, what each gives alone in the same layout."""
    from edgekv.runtime.batching import Batcher
    from edgekv.runtime.cache import KVCache

    with open_runtime(real_bundle_int4, ctx=512, backend="ort-cpu", attention="fused") as rt:
        assert rt.bundle.scheme.name == "int8-static"

        def slots():
            return Batcher(rt.backend, KVCache(rt.bundle, 512, memory=rt.backend.slot_memory(4)), parallel=4,
                           prefill_chunk=16)

        prompts = chat_prompts(rt, QUESTIONS)
        engine = slots()
        reqs = [Request(p, STEPS, record_logits=True) for p in prompts]
        for r in reqs:
            engine.submit(r)
            engine.step(), engine.step()
        run_until_done(engine, reqs)
        for r, q in zip(reqs, QUESTIONS):
            lone = Request(r.prompt, STEPS, record_logits=True)
            one = slots()
            one.submit(lone)
            run_until_done(one, [lone])
            assert_same(r.out, r.logits, lone.out, lone.logits, repr(q))
