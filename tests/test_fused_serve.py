"""Serve on fused slots (docs/serve.md, "Fused slots"): the engine's requests each in a slot of
one head-major buffer, every step one GroupQueryAttention call per layer over the slots in use.
Oracles: the same request alone on the slot layout (bit for bit: logits and tokens), the cell
pool on the graph as written (greedy tokens), the fused session's own graph (GroupQueryAttention
reading query_seqlens, no plain attention left)."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from edgekv.errors import EdgeKVError  # noqa: E402
from edgekv.format.bundle import load_bundle  # noqa: E402
from edgekv.runtime.assemble import open_runtime  # noqa: E402
from edgekv.runtime.backends.fused import QUERY_LENGTHS, QUERY_LENGTHS_ORT, ort_at_least  # noqa: E402
from edgekv.runtime.batching import Batcher, Request  # noqa: E402
from edgekv.runtime.cache import KVCache  # noqa: E402
from edgekv.serve.server import make_batcher, open_serve_runtime, serve_layout  # noqa: E402
from tests.serving import run_until_done, staggered  # noqa: E402

pytestmark = pytest.mark.skipif(not ort_at_least(ort.__version__, QUERY_LENGTHS_ORT),
                                reason=f"onnxruntime {ort.__version__} has no GroupQueryAttention query_seqlens")

SLOTS, CTX = 3, 120  # three slots of 40 cells


@pytest.fixture(scope="module")
def fused_rt(tiny_bundle_int8_static):
    with open_runtime(tiny_bundle_int8_static, ctx=CTX, backend="ort-cpu", threads=1, attention="fused") as rt:
        yield rt


@pytest.fixture(scope="module")
def plain_rt(tiny_bundle_int8_static):
    with open_runtime(tiny_bundle_int8_static, ctx=CTX, backend="ort-cpu", threads=1, attention="plain") as rt:
        yield rt


def slots_engine(rt, slots=SLOTS, chunk=8, max_prefixes=32):
    cache = KVCache(rt.bundle, CTX, memory=rt.backend.slot_memory(slots))
    return Batcher(rt.backend, cache, parallel=slots, prefill_chunk=chunk, max_prefixes=max_prefixes)


def ids(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


SPEC = {"Z": (ids(5, 9), 1), "A": (ids(7, 1), 20), "B": (ids(12, 2), 5), "C": (ids(25, 3), 8), "D": (ids(9, 4), 10)}


def schedule(engine):
    """Z comes and goes (on slots its cached prefix keeps slot 0 until needed: A and B decode
    in slots 1 and 2, the step's call not starting at slot 0); then tests/serving.py's staggered
    schedule: A alone first, B joins, C joins with a prompt prefilled over several steps (chunks
    of 8) while A and B decode, B finishes early, D joins after and gets B's slot."""
    z = Request(*SPEC["Z"], record_logits=True)
    engine.submit(z)
    run_until_done(engine, [z])
    run = staggered(engine, {k: SPEC[k] for k in "ABCD"}, prefill_steps=3)
    return {"Z": z, **run.reqs}, run.mixed, run.first_cells


def alone(rt, prompt, n):
    eng = slots_engine(rt)
    r = Request(prompt, n, record_logits=True)
    eng.submit(r)
    run_until_done(eng, [r])
    return r


def test_slots_batched_equals_alone_bit_for_bit(fused_rt):
    """Each request's logits and tokens in the batch are exactly those it gets alone: attention
    reads only its own slot from cell 0, whatever else runs beside it, in which slot, in chunks
    of what size (B's slot reused by D; C's prompt chunked beside A's and B's decode steps)."""
    eng = slots_engine(fused_rt)
    reqs, mixed, first = schedule(eng)
    assert mixed and first["A"] == 40 and first["D"] == first["B"] == 80
    for k, (prompt, n) in SPEC.items():
        want = alone(fused_rt, prompt, n)
        got = reqs[k]
        assert got.out == want.out, k
        assert len(got.logits) == len(want.logits) == n
        assert all(np.array_equal(a, b) for a, b in zip(got.logits, want.logits)), k
    assert eng.counters["preempted"] == 0


def test_slots_give_the_cell_pools_greedy_tokens(fused_rt, plain_rt):
    """The fused slots and the shared pool on the graph as written decode the same greedy tokens
    for the same requests (the same schedule)."""
    fused, _, _ = schedule(slots_engine(fused_rt))
    plain, _, _ = schedule(plain_rt.batcher(capacity=CTX, parallel=4, prefill_chunk=8))
    for k in SPEC:
        assert fused[k].out == plain[k].out, k
        np.testing.assert_allclose(np.array(fused[k].logits), np.array(plain[k].logits), atol=1e-3, rtol=0)


def test_a_prefix_is_copied_from_a_running_slot_and_reused_in_place(fused_rt):
    """A request sharing a running request's prompt copies those cells into its own slot; one
    sharing a finished request's tokens takes that slot and its cells in place; both give what
    they give alone, bit for bit."""
    shared = ids(20, 7)
    first = Request(shared + ids(3, 8), 6, record_logits=True)
    eng = slots_engine(fused_rt)
    eng.submit(first)
    while first.fed < len(first.feed):
        eng.step()
    second = Request(shared + ids(4, 9), 6, record_logits=True)
    eng.submit(second)
    run_until_done(eng, [first, second])
    assert eng.counters["copied_cells"] == 20 and eng.counters["reused_tokens"] == 20
    third = Request(first.prompt + first.out + ids(2, 10), 5, record_logits=True)
    eng.submit(third)
    run_until_done(eng, [third])
    assert eng.counters["copied_cells"] == 20  # in place: nothing copied
    assert eng.counters["reused_tokens"] == 20 + len(first.prompt) + len(first.out) - 1
    for r in (second, third):
        want = alone(fused_rt, r.prompt, 6 if r is second else 5)
        assert r.out == want.out and all(np.array_equal(a, b) for a, b in zip(r.logits, want.logits))


def test_a_request_beyond_its_slot_is_refused_in_one_line(fused_rt):
    eng = slots_engine(fused_rt)
    with pytest.raises(EdgeKVError, match=r"the prompt has 40 tokens; a slot holds 40 \(120 cells in 3 slots\)"):
        eng.submit(Request(ids(40, 1), 4))
    r = Request(ids(30, 1), 50)
    eng.submit(r)
    run_until_done(eng, [r])
    assert len(r.out) == 10 and r.finish_reason == "length"  # capped at its slot's room


def test_a_request_beyond_its_slot_gets_an_openai_error(fused_rt):
    httpx = pytest.importorskip("httpx")
    from tests.serving import built

    with built(fused_rt, ctx=CTX, slots=SLOTS) as (_, eng, url):
        assert eng.kv.limit == 40
        r = httpx.post(url + "/v1/completions", json={"prompt": "Paris " * 60, "max_tokens": 2}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 413 and err["code"] == "context_length_exceeded" and "a slot holds 40" in err["message"]
        assert "\n" not in err["message"]
        ok = httpx.post(url + "/v1/completions", json={"prompt": "Paris", "max_tokens": 3, "temperature": 0}, timeout=60)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_serve_runs_group_query_attention_on_slots(tiny_bundle_int8_static, tmp_path):
    """--slots auto on a static int8 bundle: the fused graph's session (GroupQueryAttention in
    every layer reading query_seqlens, no Softmax and no MatMul of queries by keys left), the
    cache slotted; a silent fallback to the graph as written fails here."""
    with open_serve_runtime(tiny_bundle_int8_static, CTX, "ort-cpu", 1, "auto") as rt:
        layout = serve_layout(rt, "auto", 4, CTX)
        assert layout.slots == 4 and layout.capacity == CTX and "fused slots of 30 cells" in layout.why
        eng = make_batcher(rt, layout)
        assert eng.cache.layout == "sequence-slots" and eng.parallel == 4
        be = rt.backend
        assert be.fused is not None and QUERY_LENGTHS in {i.name for i in be.session.get_inputs()}
        opts = ort.SessionOptions()
        opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                      str(rt.bundle.onnx_path.parent))
        ort.InferenceSession(be.fused.serialize(), opts, providers=["CPUExecutionProvider"])
        g = onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph
        gqa = [n for n in g.node if n.op_type == "GroupQueryAttention"]
        assert len(gqa) == rt.bundle.model["n_layers"] and all(n.input[16] == QUERY_LENGTHS for n in gqa)
        assert not any(n.op_type == "Softmax" for n in g.node)


def test_serve_chooses_the_cell_pool_where_slots_cannot_run(tiny_bundle_int8, tiny_bundle_int8_static):
    """auto on the per-token scheme: the cell pool, the load line saying why; an explicit K
    there is one line; 0 is the pool on the graph as written; a K leaving tiny slots is one line."""
    with open_serve_runtime(tiny_bundle_int8, CTX, "ort-cpu", 1, "auto") as rt:
        layout = serve_layout(rt, "auto", 4, CTX)
        assert layout.slots == 0 and "cell pool" in layout.why and "int8" in layout.why
        assert make_batcher(rt, layout).cache.layout == "slots"
    with pytest.raises(EdgeKVError, match="^--slots 2: fused attention: .*--slots 0 serves the shared cell pool"):
        open_serve_runtime(tiny_bundle_int8, CTX, "ort-cpu", 1, 2)
    with open_serve_runtime(tiny_bundle_int8_static, CTX, "ort-cpu", 1, 0) as rt:
        assert rt.backend.fused is None and serve_layout(rt, 0, 4, CTX)[:2] == (0, CTX)
        with pytest.raises(EdgeKVError, match="slot"):
            serve_layout(rt, 2, 4, CTX)  # the graph as written runs no slots
    with open_serve_runtime(tiny_bundle_int8_static, CTX, "ort-cpu", 1, 8) as rt:
        with pytest.raises(EdgeKVError, match=r"--slots 8 leaves 15 cells a slot in a context of 120"):
            serve_layout(rt, 8, 4, CTX)


def test_chat_keeps_the_cell_pool(fused_rt):
    """A held sequence (chat) on a slotted cache is refused in one line, not half run."""
    with pytest.raises(EdgeKVError, match="cell pool"):
        slots_engine(fused_rt).hold()


def test_slot_memory_speaks_cells(tiny_bundle_int8_static):
    """Every copy in and out of a slotted cache is in cells (cell c = slot c // L, position c % L):
    the same snapshots and moves as the slot-major cache."""
    from edgekv.runtime.memory import SlotMemory

    b = load_bundle(tiny_bundle_int8_static)
    plain, slotted = KVCache(b, 24), KVCache(b, 24, memory=SlotMemory(3))
    rng = np.random.default_rng(0)
    snap = {n: rng.integers(-127, 128, plain.slots_shape(n, 24)).astype(plain.dtypes[n]) for n in plain.names}
    for c in (plain, slotted):
        c.write(snap)
        c.move_cells([1, 9, 17], [10, 2, 20])
        c.move_cells(range(0, 5), range(9, 14))  # one run into another slot (two slices)
        c.move_cells(range(16, 21), range(18, 23))  # overlapping, inside one slot
    for got, want in ((slotted.read(24), plain.read(24)), (slotted.read_cells([3, 8, 16, 23]), plain.read_cells([3, 8, 16, 23]))):
        assert all(np.array_equal(got[n], want[n]) for n in plain.names)
    first = slotted.buffers[slotted.names[0]]
    assert first.shape[0] == 3 and first.shape[2] == 8  # [slots, Hkv, L, D]
    assert np.array_equal(first[1, :, 2], snap[slotted.names[0]][1][0])  # cell 10 = slot 1, position 2: cell 1's, by both moves
