"""The serving engine against its oracles: a sequence decoded in a batch with others joining and
leaving gives what it gives decoded alone (Generator, one sequence per cache); a reused prefix
gives what a fresh prefill gives; cancelled and finished sequences free their cells."""
import numpy as np
import pytest

from edgekv.errors import ContextOverflow, EdgeKVError, QueueFull
from edgekv.runtime.assemble import open_runtime
from edgekv.runtime.batching import Batcher, Request
from tests.serving import run_until_done, staggered
from tests.stream_reference import reference


def ids(n, seed=0, vocab=300):
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def alone(rt, prompt, n):
    """Greedy tokens and the logits they were taken from, one sequence in its own cache."""
    g = reference(rt, capacity=128)
    logits = g.prefill(prompt).copy()
    toks, rows = [], []
    for _ in range(n):
        rows.append(logits)
        toks.append(int(np.argmax(logits)))
        if len(toks) == n:
            break
        logits = g.decode_step(toks[-1]).copy()
    return toks, rows


def batch_schedule(engine):
    """tests/serving.py's staggered schedule: A alone first, B joins, C joins with a prompt
    prefilled over several steps while A and B decode, B leaves early, D joins after B left."""
    spec = {"A": (ids(7, 1), 20), "B": (ids(12, 2), 5), "C": (ids(30, 3), 12), "D": (ids(9, 4), 10)}
    run = staggered(engine, spec, prefill_steps=4)
    return spec, run.reqs, run.mixed


def test_batched_equals_alone_float_logits(rt_float):
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=8)
    spec, reqs, saw_mixed = batch_schedule(engine)
    assert saw_mixed, "the schedule did not mix a prefill with decodes"
    assert engine.counters["steps"] < sum(n for _, n in spec.values())  # batched: fewer steps than tokens
    for k, (prompt, n) in spec.items():
        want_toks, want_rows = alone(rt_float, prompt, n)
        assert reqs[k].out == want_toks[: len(reqs[k].out)], k
        assert reqs[k].finish_reason == "length" and len(reqs[k].out) == n, k
        np.testing.assert_allclose(np.stack(reqs[k].logits), np.stack(want_rows), atol=1e-4, rtol=1e-4, err_msg=k)
    # every request has finished: only the prefix cache holds cells
    assert engine.pool.used() == engine.pool.cached_only()


def test_batched_equals_alone_int8_greedy(rt_int8):
    engine = rt_int8.batcher(capacity=256, parallel=4, prefill_chunk=8)
    spec, reqs, _ = batch_schedule(engine)
    for k, (prompt, n) in spec.items():
        assert reqs[k].out == alone(rt_int8, prompt, n)[0], k


def test_prefix_reuse_prefills_only_the_new_tokens(rt_float):
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=16)
    system = ids(40, 7)
    first = Request(system + ids(6, 8), 4, record_logits=True)
    engine.submit(first)
    run_until_done(engine, [first])
    before = engine.counters["prefilled_tokens"]
    second = Request(system + ids(5, 9), 6, record_logits=True)
    engine.submit(second)
    run_until_done(engine, [second])
    assert second.reused >= len(system)
    assert engine.counters["prefilled_tokens"] - before == len(second.prompt) - second.reused
    # and the shared cells give what a fresh prefill gives
    want_toks, want_rows = alone(rt_float, second.prompt, 6)
    assert second.out == want_toks
    np.testing.assert_allclose(np.stack(second.logits), np.stack(want_rows), atol=1e-4, rtol=1e-4)


def test_cancel_frees_cells_at_the_next_step(rt_float):
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=16, max_prefixes=0)
    a, b = Request(ids(10, 1), 50), Request(ids(10, 2), 50)
    engine.submit(a), engine.submit(b)
    for _ in range(6):
        engine.step()
    held = engine.pool.used()
    a_cells = list(a.seq.cells)
    assert held == len(a.seq.cells) + len(b.seq.cells) and len(a_cells) > 10
    engine.cancel(a)
    engine.step()
    assert a.finish_reason == "cancelled"
    # its cells were freed before the step ran (the step may have moved b into them): the pool
    # holds exactly b's cells, and b goes on exactly
    assert set(np.flatnonzero(engine.pool.refs).tolist()) == set(b.seq.cells)
    assert engine.pool.used() == len(b.seq.cells)
    run_until_done(engine, [b])
    assert engine.pool.used() == 0
    assert b.out == alone(rt_float, b.prompt, 50)[0]


def test_queue_bound(rt_float):
    """With every slot taken, max_queue requests wait and the next is refused; the waiting ones
    run in turn (cells are reserved on demand: tests/test_engine_hardening.py)."""
    engine = rt_float.batcher(capacity=64, parallel=1, max_queue=2, prefill_chunk=16, max_prefixes=0)
    a, b, c = Request(ids(20, 1), 30), Request(ids(20, 2), 30), Request(ids(5, 3), 5)
    engine.submit(a), engine.submit(b), engine.submit(c)
    with pytest.raises(QueueFull):
        engine.submit(Request(ids(5, 4), 5))
    engine.step()
    assert engine.running == [a] and list(engine.waiting) == [b, c]
    run_until_done(engine, [a, b, c])
    assert b.out == alone(rt_float, b.prompt, 30)[0]
    with pytest.raises(ContextOverflow):
        engine.submit(Request(ids(64, 4), 5))


def churn(engine):
    """Many short requests coming and going in a small pool: without compaction its free cells
    end up in holes between running and cached ones."""
    reqs = [Request(ids(5 + (i * 7) % 13, 100 + i), 3 + (i * 5) % 9) for i in range(14)]
    for r in reqs:
        engine.submit(r)
        engine.step()
    run_until_done(engine, reqs)
    return reqs


def test_a_churning_pool_is_compacted_and_stays_exact(rt_float):
    """Cells are moved (compaction) so every step is one call, and every sequence still equals
    its lone decode: the moved K/V rows and every owner's renamed cells agree."""
    engine = rt_float.batcher(capacity=96, parallel=6, max_queue=64, prefill_chunk=8, max_prefixes=4)
    reqs = churn(engine)
    assert engine.counters["moved_cells"] > 0
    assert engine.counters["calls"] == engine.counters["steps"]
    for r in reqs:
        assert r.out == alone(rt_float, r.prompt, len(r.out))[0]


def test_inside_a_turn_a_fragmented_step_is_split_and_stays_exact(rt_float):
    """A turn (chat) never moves cells (its rollback restores owners, not moved rows): the step
    is split over the free runs there are instead."""
    engine = rt_float.batcher(capacity=96, parallel=6, max_queue=64, prefill_chunk=8, max_prefixes=4)
    with engine.turn():
        reqs = churn(engine)
    assert engine.counters["moved_cells"] == 0
    assert engine.counters["calls"] > engine.counters["steps"]  # some steps ran as several calls
    for r in reqs:
        assert r.out == alone(rt_float, r.prompt, len(r.out))[0]


def test_prefix_cache_gives_way_when_cells_are_needed(rt_float):
    engine = rt_float.batcher(capacity=64, parallel=2, prefill_chunk=16)
    a = Request(ids(30, 1), 4)
    engine.submit(a)
    run_until_done(engine, [a])
    # a's prompt and the 3 reply tokens it fed are cached
    assert engine.pool.used() == engine.pool.cached_only() == 33
    b = Request(ids(20, 2), 30)  # needs 49 cells: only 31 are free until the cache gives way
    engine.submit(b)
    run_until_done(engine, [b])
    assert not engine.pool.prefixes.get(tuple(a.prompt + a.out[:3]))
    assert b.out == alone(rt_float, b.prompt, 30)[0]


# the real model batched = alone: tests/test_int4_determinism.py (the same four chat prompts joining
# two steps apart, on the run's one real bundle; tokens and logits bit for bit)


def test_a_backend_without_run_cells_is_refused_in_one_line(rt_float):
    class OneSequenceBackend:  # every member of Backend but run_cells
        name, device, memory, max_tokens_per_call, past_bucket = "trt", "cuda", None, 64, 1

        def close(self):
            pass

    class Rt:
        backend = OneSequenceBackend()

    with pytest.raises(EdgeKVError, match="needs a backend that runs a pool of cells"):
        Batcher(Rt.backend, None)


def test_next_turn_reuses_the_reply_and_equals_a_fresh_prefill(rt_float):
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=16)
    first = Request(ids(30, 11), 8)
    engine.submit(first)
    run_until_done(engine, [first])
    assert first.finish_reason == "length" and len(first.out) == 8
    # the client sends the conversation back: prompt, the reply, its next message
    turn = first.prompt + first.out + ids(6, 12)
    second = Request(turn, 5, record_logits=True)
    before = engine.counters["prefilled_tokens"]
    engine.submit(second)
    run_until_done(engine, [second])
    # every fed token of the first request was reused: its prompt and the first 7 reply tokens
    # (the 8th was sampled, never fed)
    assert second.reused == len(first.prompt) + len(first.out) - 1
    assert engine.counters["prefilled_tokens"] - before == len(turn) - second.reused
    want_toks, want_rows = alone(rt_float, turn, 5)
    assert second.out == want_toks
    np.testing.assert_allclose(np.stack(second.logits), np.stack(want_rows), atol=1e-4, rtol=1e-4)


def test_a_cancelled_reply_is_not_cached(rt_float):
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=16)
    req = Request(ids(20, 13), 30)
    engine.submit(req)
    for _ in range(6):
        engine.step()
    assert len(req.out) >= 3
    engine.cancel(req)
    engine.step()
    assert req.finish_reason == "cancelled"
    k, _ = engine.pool.lookup(req.prompt + req.out)
    assert k == len(req.prompt)  # the prompt was cached when it was prefilled; the reply was not


def test_a_prompt_gets_a_contiguous_run_when_cached_prefixes_fragment_the_pool(rt_float, monkeypatch):
    # a bucket past the capacity: no compaction shortens the past, so the pool stays fragmented
    # until a prompt needs a run
    monkeypatch.setattr(rt_float.backend, "past_bucket", 128)
    engine = rt_float.batcher(capacity=100, parallel=4, prefill_chunk=32)
    # four requests decoded together: their cells interleave, one token of each per step
    reqs = [Request(ids(6, 40 + i), 20) for i in range(4)]
    for r in reqs:
        engine.submit(r)
    for _ in range(8):
        engine.step()
    engine.cancel(reqs[0])  # two leave early: their cells become one-cell holes between the others'
    engine.cancel(reqs[2])
    run_until_done(engine, reqs)
    assert engine.pool.free_run(32)[1] < 32  # the other two stay cached, scattered
    calls = engine.counters["calls"]
    long = Request(ids(32, 31), 4)
    engine.submit(long)
    engine.step()  # admitted and its whole prompt prefilled
    assert long.fed == 32
    assert engine.counters["calls"] - calls == 1, "the prompt was split over fragmented runs"
    run_until_done(engine, [long])
    assert long.out == alone(rt_float, long.prompt, 4)[0]


def test_cached_conversations_do_not_lengthen_the_past_a_step_binds(rt_float, monkeypatch):
    """Eight finished conversations stay cached; a new request's steps bind only its own cells
    (rounded to the bucket), the cached cells moved above them, and a later turn of a cached
    conversation, its cells moved, still equals a fresh prefill."""
    monkeypatch.setattr(rt_float.backend, "past_bucket", 8)
    engine = rt_float.batcher(capacity=256, parallel=8, prefill_chunk=16)
    first = [Request(ids(12, 60 + i), 10) for i in range(8)]
    for r in first:
        engine.submit(r)
    run_until_done(engine, first)
    assert engine.pool.cached_only() >= 8 * 20
    bound = []
    run = rt_float.backend.run_cells
    monkeypatch.setattr(rt_float.backend, "run_cells", lambda cache, p, *a: bound.append(p) or run(cache, p, *a))
    new = Request(ids(10, 70), 20, record_logits=True)
    engine.submit(new)
    engine.step()  # the cached cells make way before the new prompt is written, not after
    landed = list(new.seq.cells)
    engine.step()
    assert new.seq.cells[: len(landed)] == landed, "the new prompt was written above the cached cells, then moved"
    run_until_done(engine, [new])
    assert engine.counters["moved_cells"] > 0
    assert max(bound) <= 32, f"bound {max(bound)} cells for a sequence of at most 30"
    assert new.out == alone(rt_float, new.prompt, 20)[0]
    # the fourth conversation's next turn takes its moved cells and equals a fresh prefill
    turn = first[3].prompt + first[3].out + ids(4, 71)
    again = Request(turn, 6, record_logits=True)
    engine.submit(again)
    run_until_done(engine, [again])
    assert again.reused == len(first[3].prompt) + len(first[3].out) - 1
    want_toks, want_rows = alone(rt_float, turn, 6)
    assert again.out == want_toks
    np.testing.assert_allclose(np.stack(again.logits), np.stack(want_rows), atol=1e-4, rtol=1e-4)


class OnlyThese:
    """A test Constraint: only `allowed` tokens may come next; done after `done_after` tokens."""

    def __init__(self, vocab, allowed, done_after=None):
        self.mask = np.zeros(vocab, np.bool_)
        self.mask[list(allowed)] = True
        self.accepted, self.done_after = [], done_after

    def allowed(self):
        return self.mask

    def accept(self, token):
        if not self.mask[token]:
            raise ValueError(f"token {token} was not allowed")
        self.accepted.append(token)

    def is_done(self):
        return self.done_after is not None and len(self.accepted) >= self.done_after


def test_a_constraint_makes_greedy_pick_among_its_tokens_alone_and_in_a_batch(rt_float):
    """Post-processing masks each row with the request's constraint before sampling and tells it
    the token after: greedy picks the best allowed token (the oracle: the argmax of the
    recorded, unconstrained row over the allowed set), alone and beside unconstrained requests."""
    vocab = rt_float.bundle.model["vocab_size"]
    allowed = list(range(40, 60))
    prompt = ids(11, 30)

    def constrained():
        return Request(prompt, 6, record_logits=True, constraint=OnlyThese(vocab, allowed))

    alone_engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=8)
    solo = alone_engine.submit(constrained())
    run_until_done(alone_engine, [solo])
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=8)
    others = [Request(ids(9, 31), 6), Request(ids(13, 32), 6)]
    batched = constrained()
    for r in (others[0], batched, others[1]):
        engine.submit(r)
    run_until_done(engine, [batched, *others])
    for r in (solo, batched):
        assert r.finish_reason == "length" and len(r.out) == 6 and r.ask.constraint.accepted == r.out
        want = [allowed[int(np.argmax(row[allowed]))] for row in r.logits]
        assert r.out == want
        assert any(int(np.argmax(row)) not in allowed for row in r.logits)  # the mask changed something
    assert batched.out == solo.out
    for r in others:  # the neighbours are unconstrained
        assert r.out == alone(rt_float, r.prompt, 6)[0]


def test_a_done_constraint_ends_the_request_with_stop(rt_float):
    vocab = rt_float.bundle.model["vocab_size"]
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=8)
    r = engine.submit(Request(ids(11, 33), 20, constraint=OnlyThese(vocab, range(40, 60), done_after=3)))
    run_until_done(engine, [r])
    assert r.finish_reason == "stop" and len(r.out) == 3


def test_teacher_forced_rows_equal_the_generators(rt_float):
    """`logits_from` returns the rows of the prompt's tokens from that index on as they are fed
    (over several chunks, beside another request, and on a kept sequence): the oracle is the
    Generator's prefill with all_logits."""
    prompt = ids(40, 34)
    g = reference(rt_float, capacity=128, prefill_chunk=8)
    want = g.prefill(prompt, all_logits=True, logits_from=13)
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=8)
    other = engine.submit(Request(ids(9, 35), 5))
    scored = engine.submit(Request(prompt, 1, logits_from=13))
    run_until_done(engine, [other, scored])
    np.testing.assert_allclose(np.stack(scored.logits), want, atol=1e-4, rtol=1e-4)
    assert other.out == alone(rt_float, other.prompt, 5)[0]
    chat = rt_float.batcher(capacity=128, parallel=1, max_queue=1, prefill_chunk=8, max_prefixes=0)
    seq = chat.hold()
    kept = chat.run(Request(prompt, 0, seq=seq, logits_from=13))
    np.testing.assert_allclose(np.stack(kept.logits), want, atol=1e-4, rtol=1e-4)


def test_a_request_walks_its_explicit_states(rt_float):
    """Request.state says where a request is (no implicit markers): waiting, prefilling while its
    prompt goes in, decoding, closing while a kept sequence's last token is fed, done."""
    from edgekv.runtime.batching import State

    def states(engine, req):
        seen = [req.state]
        engine.submit(req)
        seen.append(req.state)
        while req.finish_reason is None:
            engine.step()
            if req.state is not seen[-1]:
                seen.append(req.state)
        return seen

    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=8)
    assert states(engine, Request(ids(20, 40), 3)) == [State.WAITING, State.WAITING, State.PREFILLING,
                                                       State.DECODING, State.DONE]
    chat = rt_float.batcher(capacity=128, parallel=1, max_queue=1, prefill_chunk=8, max_prefixes=0)
    kept = Request(ids(20, 41), 2, seq=chat.hold(), feed_last=True)
    assert states(chat, kept) == [State.WAITING, State.WAITING, State.PREFILLING, State.DECODING, State.CLOSING,
                                  State.DONE]
    assert kept.ask.seq.ids == kept.prompt + kept.out  # the closing step fed the last token


def test_serve_runs_the_graph_as_written(tiny_bundle_int8_static, monkeypatch):
    """onnxruntime's fused attention is not bit for bit the same batched as alone (docs/fused.md):
    serve's runtime on a static int8 bundle (which `auto` would fuse) runs the graph as written,
    even when EDGEKV_ATTENTION asks for fused; the same bundle opened otherwise does fuse."""
    from edgekv.serve.server import open_serve_runtime
    static = tiny_bundle_int8_static
    with open_runtime(static, ctx=64, backend="ort-cpu", threads=1) as rt:
        if rt.backend.fused is None:  # this onnxruntime cannot fuse: nothing to keep serve from
            pytest.skip(rt.backend.attention)
    monkeypatch.setenv("EDGEKV_ATTENTION", "fused")
    with open_serve_runtime(static, 64, "ort-cpu", 1) as rt:
        assert rt.backend.fused is None and "as written" in rt.backend.attention, rt.backend.attention
