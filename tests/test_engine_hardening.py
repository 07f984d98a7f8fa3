"""The serving engine against a hostile or unlucky client (issue 22): one request's sampling
error ends only that request; the engine says when it is failing everything (`fault`); cells are
reserved on demand and a pool too small for every max_tokens preempts (recompute) instead of
serialising, each request still giving its lone decode; prefixes are reused only within a
tenant; `max_queue` 0 means "nothing waits", not "nothing runs"."""
import numpy as np
import pytest

import edgekv.runtime.batching.scheduler as scheduler_module
from edgekv.errors import QueueFull
from edgekv.runtime.batching import FAULT_STEPS, Done, Request, Token
from edgekv.runtime.sampling import SamplingParams
from tests.test_serve_compaction_fuzz import assert_each_equals_alone, check_pool, random_schedule
from tests.test_serve_engine import alone, ids


def run_checked(engine, reqs, max_steps=3000, each=None):
    """Step until every request ends, the pool's bookkeeping checked after every step."""
    for _ in range(max_steps):
        if all(r.finish_reason for r in reqs):
            return
        engine.step()
        check_pool(engine)
        if each:
            each()
    raise AssertionError("requests did not finish")


def assert_clean(engine):
    assert not engine.running and not engine.waiting
    assert engine.scheduler.reserved() == 0
    assert engine.pool.used() == engine.pool.cached_only()  # only the prefix cache holds cells


# -- 1. one request's sampling error ends only that request ---------------------------------------

class Exploding:
    """A sampler's random source that fails on its third draw."""

    def __init__(self):
        self.n = 0

    def random(self):
        self.n += 1
        if self.n == 3:
            raise RuntimeError("the sampler broke")
        return 0.5


def events_of(log, key):
    """An emit that logs (key, "token", id) and (key, "done", reason)."""
    def emit(ev):
        log.append((key, "token", ev.id) if isinstance(ev, Token) else (key, "done", ev.reason))
    return emit


def test_a_sampling_error_ends_only_its_own_request(rt_float):
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=8)
    log = []
    good = [Request(ids(9, 1), 12, record_logits=True, emit=events_of(log, "good0")),
            Request(ids(14, 2), 10, record_logits=True, emit=events_of(log, "good1"))]
    bad = Request(ids(11, 3), 10, SamplingParams(temperature=1.0), rng=Exploding(), emit=events_of(log, "bad"))
    for r in (good[0], bad, good[1]):
        engine.submit(r)
    run_checked(engine, good + [bad])
    assert bad.finish_reason == "error" and "the sampler broke" in bad.error
    assert len(bad.out) == 2 and ("bad", "done", "error") in log
    for r in good:
        want_toks, want_rows = alone(rt_float, r.prompt, r.max_tokens)
        assert r.finish_reason == "length" and r.out == want_toks
        np.testing.assert_allclose(np.stack(r.logits), np.stack(want_rows), atol=1e-4, rtol=1e-4)
    assert_clean(engine)
    assert engine.fault() is None  # one client's error is not the engine's


def test_an_emit_that_raises_ends_only_its_own_request(rt_float):
    """Stop handling raising (here the request's own callback, every time it is called)."""
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=8)

    def broken(event):
        raise ValueError("the client's queue is gone")

    good = Request(ids(9, 4), 8)
    bad = Request(ids(10, 5), 8, emit=broken)
    engine.submit(bad), engine.submit(good)
    run_checked(engine, [good, bad])
    assert bad.finish_reason == "error" and "queue is gone" in bad.error
    assert good.finish_reason == "length" and good.out == alone(rt_float, good.prompt, 8)[0]
    assert_clean(engine)


def test_a_subnormal_temperature_beside_others_is_greedy(rt_float):
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=8)
    reqs = [Request(ids(9, 6), 8), Request(ids(12, 7), 8, SamplingParams(temperature=1e-310, seed=1)),
            Request(ids(7, 8), 8)]
    for r in reqs:
        engine.submit(r)
    run_checked(engine, reqs)
    for r in reqs:
        assert r.finish_reason == "length" and r.out == alone(rt_float, r.prompt, 8)[0]


# -- 2. fault(): the engine failing everything ----------------------------------------------------

def test_fault_while_every_step_gives_non_finite_logits_and_reset_by_a_good_step(rt_float, monkeypatch):
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=16)
    run = rt_float.backend.run_cells
    damaged = {"rows": "all"}

    def run_cells(*a):
        logits = run(*a).copy()
        if damaged["rows"] == "all":
            logits[:] = np.nan
        elif damaged["rows"] == "first":
            logits[0, 0] = np.nan
        return logits

    monkeypatch.setattr(rt_float.backend, "run_cells", run_cells)
    assert engine.fault() is None
    failed = []
    for i in range(FAULT_STEPS):
        r = Request(ids(6, 20 + i), 4)
        engine.submit(r)
        engine.step()
        assert r.finish_reason == "error"
        failed.append(engine.fault())
    assert failed[:-1] == [None] * (FAULT_STEPS - 1)  # a few failed requests are not yet a fault
    assert "non-finite" in failed[-1] and "\n" not in failed[-1]
    # one row of two damaged: the step still produced a token, the engine works
    damaged["rows"] = "first"
    a, b = Request(ids(6, 30), 3), Request(ids(6, 31), 3)
    engine.submit(a), engine.submit(b)
    engine.step()
    assert engine.fault() is None
    assert {a.finish_reason, b.finish_reason} == {"error", None}


def test_many_requests_whose_own_sampling_fails_are_not_a_fault(rt_float):
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=8)
    for i in range(2 * FAULT_STEPS):
        r = Request(ids(6, 40 + i), 6, SamplingParams(temperature=1.0), rng=Exploding())
        engine.submit(r)
        run_checked(engine, [r])
        assert r.finish_reason == "error"
    assert engine.fault() is None


def test_a_step_that_raises_counts_towards_a_fault(rt_float, monkeypatch):
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=8)

    def broken(*a):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(rt_float.backend, "run_cells", broken)
    for i in range(FAULT_STEPS):
        engine.submit(Request(ids(6, 50 + i), 4))
        with pytest.raises(RuntimeError):
            engine.step()
    assert "the device is gone" in engine.fault()


# -- 3. cells on demand, preemption by recompute ---------------------------------------------------

def test_a_short_request_starts_while_a_long_one_runs(rt_float):
    """A request whose max_tokens would fill the pool no longer holds it: a short request that
    comes later is admitted at the next step and ends first (before: it waited for the long one)."""
    engine = rt_float.batcher(capacity=128, parallel=4, prefill_chunk=16)
    long = Request(ids(8, 60), 112)  # prompt + max_tokens - 1 = 119 of 128 cells
    engine.submit(long)
    for _ in range(5):
        engine.step()
    short = Request(ids(7, 61), 5)
    engine.submit(short)
    engine.step()
    assert short in engine.running
    run_checked(engine, [short])
    assert long.finish_reason is None, "the short request waited for the long one"
    run_checked(engine, [long])
    assert short.out == alone(rt_float, short.prompt, 5)[0]
    assert long.out == alone(rt_float, long.prompt, 112)[0]
    assert_clean(engine)


def test_a_pool_too_small_for_every_max_tokens_preempts_and_each_equals_alone(rt_float):
    """Three requests whose prompt + max_tokens add up to twice the pool: all run at once until
    the pool is full, the youngest is preempted (its cells freed, its prompt and reply prefilled
    again later) and every one gives its lone greedy tokens and logits."""
    engine = rt_float.batcher(capacity=96, parallel=4, prefill_chunk=16)
    spec = [(ids(10, 70), 60), (ids(12, 71), 50), (ids(9, 72), 55)]
    emitted = {k: [] for k in range(len(spec))}
    reqs = [Request(p, n, record_logits=True, emit=lambda ev, k=k: isinstance(ev, Token) and emitted[k].append(ev.id))
            for k, (p, n) in enumerate(spec)]
    for r in reqs:
        engine.submit(r)
    engine.step()
    assert len(engine.running) == 3  # all admitted at once (before: one at a time)
    run_checked(engine, reqs)
    assert engine.counters["preempted"] > 0
    assert reqs[-1].preempted > 0 and reqs[0].preempted == 0  # the youngest gave way, the oldest never
    for k, r in enumerate(reqs):
        want_toks, want_rows = alone(rt_float, r.prompt, r.max_tokens)
        assert r.finish_reason == "length" and r.out == want_toks
        assert emitted[k] == r.out  # no token emitted twice or lost across a preemption
        np.testing.assert_allclose(np.stack(r.logits), np.stack(want_rows), atol=1e-4, rtol=1e-4)
    assert engine.counters["requests"] == 3
    assert_clean(engine)


def test_a_preempted_request_resumes_from_its_cached_prompt(rt_float):
    """The prompt's cells stay in the prefix cache while the reply's are enough to free: the
    preempted request prefills only its reply again (and still equals its lone decode)."""
    engine = rt_float.batcher(capacity=96, parallel=4, prefill_chunk=16)
    old, young = Request(ids(10, 75), 41), Request(ids(30, 76), 40, record_logits=True)
    resumed, admit = [], engine.scheduler._admit_new

    def spy(req):
        ok = admit(req)
        if ok and req.preempted:
            resumed.append(req.fed)  # tokens taken from the cache at its readmission
        return ok

    engine.scheduler._admit_new = spy
    engine.submit(old), engine.submit(young)
    run_checked(engine, [old, young])
    assert young.preempted and resumed and min(resumed) >= len(young.prompt)
    want_toks, want_rows = alone(rt_float, young.prompt, 40)
    assert young.out == want_toks and old.out == alone(rt_float, old.prompt, 41)[0]
    np.testing.assert_allclose(np.stack(young.logits), np.stack(want_rows), atol=1e-4, rtol=1e-4)
    assert young.reused == 0  # what the client is told: nothing of its prompt was cached when it came


def test_a_preempted_sampled_request_draws_what_it_draws_uninterrupted(rt_float):
    """Recompute leaves the request's random source alone: with a seed it draws the same tokens
    preempted or not (the logits are the same to float rounding)."""
    prompt, params = ids(10, 80), SamplingParams(temperature=0.8, seed=5)
    roomy = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=16)
    ref = Request(prompt, 50, params)
    roomy.submit(ref)
    run_checked(roomy, [ref])
    small = rt_float.batcher(capacity=80, parallel=4, prefill_chunk=16)
    first, again = Request(ids(9, 81), 60), Request(prompt, 50, params)
    small.submit(first), small.submit(again)
    run_checked(small, [first, again])
    assert again.preempted > 0
    assert again.out == ref.out


def test_preemption_in_random_schedules_keeps_the_books_and_each_equals_alone(rt_float, monkeypatch):
    """The compaction fuzz schedules with a headroom of one cell: requests are admitted into a
    full pool and preempted often (cancelled while waiting to resume, too), every step's pool
    checked against its owners."""
    monkeypatch.setattr(scheduler_module, "HEADROOM", 1)
    preempted = 0
    for seed in range(400, 406):
        engine, reqs, _ = random_schedule(rt_float, seed, True, monkeypatch, caps=(24, 40, 64))
        assert_each_equals_alone(rt_float, reqs, logits=True)
        assert engine.scheduler.reserved() == 0
        preempted += engine.counters["preempted"]
    assert preempted > 0


# -- 4. prefixes per tenant ---------------------------------------------------------------------------

def test_a_prefix_is_reused_only_by_its_own_tenant(rt_float):
    engine = rt_float.batcher(capacity=256, parallel=4, prefill_chunk=16)
    system = ids(40, 90)
    a1 = Request(system + ids(5, 91), 4, tenant="a")
    engine.submit(a1)
    run_checked(engine, [a1])
    before = engine.counters["prefilled_tokens"]
    b = Request(system + ids(5, 92), 4, tenant="b")
    engine.submit(b)
    run_checked(engine, [b])
    assert b.reused == 0 and engine.counters["prefilled_tokens"] - before == len(b.prompt)
    assert b.out == alone(rt_float, b.prompt, 4)[0]
    a2 = Request(system + ids(5, 93), 4, tenant="a")
    engine.submit(a2)
    run_checked(engine, [a2])
    assert a2.reused >= len(system)
    assert a2.out == alone(rt_float, a2.prompt, 4)[0]
    # a's whole conversation sent by b: b reuses only what its own cached conversation shares
    b2 = Request(a1.prompt + a1.out + ids(3, 94), 4, tenant="b")
    engine.submit(b2)
    run_checked(engine, [b2])
    own = b.prompt + b.out
    assert b2.reused == next(i for i, (x, y) in enumerate(zip(b2.prompt, own)) if x != y) < len(a1.prompt)


# -- 5. max_queue 0: nothing waits, what can start starts -------------------------------------------

def test_queue_zero_starts_what_can_start_and_refuses_what_would_wait(rt_float):
    engine = rt_float.batcher(capacity=128, parallel=1, max_queue=0, prefill_chunk=16)
    a = Request(ids(8, 100), 20)
    engine.submit(a)  # an idle engine: it starts
    engine.step()
    assert a in engine.running
    with pytest.raises(QueueFull):  # the one slot is taken: it would wait
        engine.submit(Request(ids(8, 101), 4))
    run_checked(engine, [a])
    b = Request(ids(8, 102), 4)
    engine.submit(b)  # idle again
    run_checked(engine, [b])
    assert b.out == alone(rt_float, b.prompt, 4)[0]


def test_queue_zero_refuses_a_request_whose_cells_are_not_free(rt_float):
    engine = rt_float.batcher(capacity=64, parallel=4, max_queue=0, prefill_chunk=16, max_prefixes=0)
    a = Request(ids(40, 103), 20)
    engine.submit(a)
    engine.step()
    with pytest.raises(QueueFull):  # a slot is free, but not its 30 + headroom cells
        engine.submit(Request(ids(30, 104), 4))
    engine.submit(Request(ids(3, 105), 2))  # these fit beside it


# -- 6. submit leaves the caller's fields alone ---------------------------------------------------------

def test_submit_does_not_rewrite_max_tokens(rt_float):
    engine = rt_float.batcher(capacity=64, parallel=4, prefill_chunk=16)
    r = Request(ids(20, 110), 10 ** 6)
    engine.submit(r)
    run_checked(engine, [r])
    assert r.max_tokens == 10 ** 6
    assert r.finish_reason == "length" and len(r.out) == 64 - 20


def test_feed_last_needs_a_kept_sequence():
    """Feeding a reply's last token is for a kept sequence (chat); a request's own cells are freed
    at its end, so nothing would hold it: refused when the request is made."""
    with pytest.raises(ValueError, match="kept sequence"):
        Request(ids(4, 120), 3, feed_last=True)


def test_a_step_that_plans_nothing_for_running_requests_raises_instead_of_spinning(rt_float, monkeypatch):
    """Running requests none of which can go on (a scheduling bug) end the step with an error, so
    chat's run and serve's loop fail them instead of stepping forever."""
    engine = rt_float.batcher(capacity=64, parallel=2, prefill_chunk=8)
    r = engine.submit(Request(ids(6, 121), 4))
    engine.step()
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: [])
    with pytest.raises(RuntimeError, match="planned nothing"):
        engine.step()
    assert r in engine.running  # nothing was decided for it: serve's loop then fails it
