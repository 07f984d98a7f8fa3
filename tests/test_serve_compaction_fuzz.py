"""Hostile schedules for the serving engine's compaction: random arrivals, prompt lengths,
max_tokens, cancels (waiting, mid-prefill, mid-decode), later turns and shared prefixes of
earlier conversations (cells moved, maybe several times, then reused), tiny pools where
admission evicts, small per-call limits, stop tokens. After every step the pool's bookkeeping
is checked against its owners; at every call every cell of its requests lies in the bound past
and the write run is free; every sequence equals its lone decode (float KV: logits 1e-4)."""
import threading
import time

import numpy as np
import pytest

from edgekv.runtime.batching import Request
from tests.test_serve_engine import alone, ids


def check_pool(engine):
    pool = engine.pool
    owners = np.zeros(pool.capacity, np.int64)
    cache = np.zeros(pool.capacity, np.int64)
    for r in engine.running:
        cells = r.seq.cells
        c = np.asarray(cells, np.int64)
        assert len(set(cells)) == len(cells), "a request holds a cell twice"
        assert ((c >= 0) & (c < pool.capacity)).all()
        assert r.kept or len(cells) == r.seq.pos
        if not r.kept:
            np.add.at(owners, c, 1)
    for key, cells in pool.prefixes.items():
        assert len(cells) == len(key) and len(set(cells.tolist())) == len(cells)
        np.add.at(owners, cells, 1)
        np.add.at(cache, cells, 1)
    for h in engine.kv.kept:
        np.add.at(owners, np.asarray(h.cells, np.int64), 1)
    assert (pool.refs == owners).all(), "refs != owners"
    assert (pool.cache_refs == cache).all(), "cache_refs != the prefix entries"
    assert pool.used() + engine.scheduler.reserved() <= pool.capacity


def instrument(engine, calls):
    orig = engine.runner.run

    def run(call):
        p, w, s = call.past, call.write, call.size
        assert p == engine.kv.past()
        assert 0 <= w and w + s <= engine.capacity and (engine.pool.refs[w: w + s] == 0).all(), "write run not free"
        for piece in call.pieces:
            cells = piece.seq.cells
            assert not cells or max(cells) < p, ("a cell outside the bound past", max(cells), p)
        calls.append((p, w, s))
        return orig(call)
    engine.runner.run = run


def random_schedule(rt, seed, record, monkeypatch, caps=(40, 64, 96, 128), stop_ids=frozenset()):
    rng = np.random.default_rng(seed)
    cap = int(rng.choice(caps))
    monkeypatch.setattr(rt.backend, "past_bucket", int(rng.choice([1, 3, 8, 128])))
    engine = rt.batcher(capacity=cap, parallel=int(rng.integers(1, 7)), max_queue=64,
                       prefill_chunk=int(rng.integers(1, 17)), max_prefixes=int(rng.integers(0, 6)))
    calls, reqs, convs = [], [], []
    instrument(engine, calls)
    for _ in range(int(rng.integers(30, 90))):
        if rng.random() < 0.35:
            if convs and rng.random() < 0.5:  # a later turn of an earlier conversation, or a shared prefix
                base = convs[int(rng.integers(len(convs)))]
                prompt = base[: int(rng.integers(1, len(base) + 1))] + ids(int(rng.integers(0, 8)), int(rng.integers(1 << 30)))
            else:
                prompt = ids(int(rng.integers(1, 30)), int(rng.integers(1 << 30)))
            prompt = prompt[: min(len(prompt), cap - 2)]
            r = Request(prompt, int(rng.integers(1, min(20, cap - len(prompt)) + 1)), record_logits=record,
                        stop_ids=set(stop_ids))
            engine.submit(r)
            reqs.append(r)
        if reqs and rng.random() < 0.08:
            engine.cancel(reqs[int(rng.integers(len(reqs)))])
        engine.step()
        check_pool(engine)
        convs += [r.prompt + r.out for r in reqs if r.finish_reason in ("length", "stop") and r.prompt + r.out not in convs]
    for _ in range(3000):
        if all(r.finish_reason for r in reqs):
            break
        engine.step()
        check_pool(engine)
    assert all(r.finish_reason for r in reqs)
    assert engine.pool.used() == engine.pool.cached_only()
    return engine, reqs, calls


ORACLE = {}


def lone(rt, prompt, n):
    key = (id(rt), tuple(prompt))
    if key not in ORACLE or len(ORACLE[key][0]) < n:
        ORACLE[key] = alone(rt, prompt, n)
    toks, rows = ORACLE[key]
    return toks[:n], rows[:n]


def assert_each_equals_alone(rt, reqs, logits: bool) -> None:
    """Every request's tokens (and, float KV, its logits to 1e-4) = its lone decode."""
    for r in reqs:
        if r.out:
            want, rows = lone(rt, r.prompt, len(r.out))
            assert r.out == want
            if logits:
                np.testing.assert_allclose(np.stack(r.logits), np.stack(rows), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seed", range(16))
def test_random_schedules_float_equal_alone(rt_float, seed, monkeypatch):
    _, reqs, _ = random_schedule(rt_float, seed, True, monkeypatch)
    assert_each_equals_alone(rt_float, reqs, logits=True)


@pytest.mark.parametrize("seed", range(100, 106))
def test_random_schedules_int8_greedy_equal_alone(rt_int8, seed, monkeypatch):
    _, reqs, _ = random_schedule(rt_int8, seed, False, monkeypatch)
    assert_each_equals_alone(rt_int8, reqs, logits=False)


@pytest.mark.parametrize("seed", range(300, 310))
def test_random_schedules_in_tiny_pools(rt_float, seed, monkeypatch):
    """8 to 24 cells: admission evicts cached conversations, compaction every few steps."""
    _, reqs, _ = random_schedule(rt_float, seed, True, monkeypatch, caps=(8, 12, 16, 24))
    assert_each_equals_alone(rt_float, reqs, logits=True)


@pytest.mark.parametrize("seed", range(200, 208))
def test_random_schedules_with_a_call_limit_and_stop_tokens(rt_float, seed, monkeypatch):
    """A TensorRT-like limit of tokens per call, and stop tokens (early finishes, cached replies)."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(rt_float.backend, "max_tokens_per_call", int(rng.integers(2, 9)))
    stop = frozenset(int(t) for t in rng.integers(3, 300, 25))
    _, reqs, calls = random_schedule(rt_float, seed, False, monkeypatch, stop_ids=stop)
    assert max(s for _, _, s in calls) <= rt_float.backend.max_tokens_per_call
    for r in reqs:
        want = lone(rt_float, r.prompt, r.max_tokens)[0]
        cut = next((i for i, t in enumerate(want) if t in stop), len(want))
        if r.finish_reason == "stop":
            assert r.out == want[:cut]
        else:
            assert r.out == want[: len(r.out)] and len(r.out) <= cut


def test_engine_thread_with_concurrent_submits_cancels_and_stats(rt_float, monkeypatch):
    monkeypatch.setattr(rt_float.backend, "past_bucket", 4)
    engine = rt_float.batcher(capacity=80, parallel=5, max_queue=200, prefill_chunk=6, max_prefixes=4).start()
    done, errors = threading.Event(), []

    def poll():
        try:
            while not done.is_set():
                st = engine.stats()
                assert st["cells_used"] + st["cells_free"] == st["capacity"] == 80
                assert 0 <= st["cells_bound"] <= 80
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    t = threading.Thread(target=poll)
    t.start()
    rng = np.random.default_rng(9)
    reqs, convs = [], []
    try:
        for i in range(60):
            if convs and rng.random() < 0.5:
                p = (convs[int(rng.integers(len(convs)))] + ids(3, 500 + i))[:60]
            else:
                p = ids(int(rng.integers(1, 25)), 300 + i)
            reqs.append(engine.submit(Request(p, int(rng.integers(1, 12)))))
            time.sleep(float(rng.random()) * 0.01)
            if rng.random() < 0.15:
                engine.cancel(reqs[int(rng.integers(len(reqs)))])
            convs += [q.prompt + q.out for q in reqs if q.finish_reason == "length"]
        deadline = time.time() + 120
        while not all(r.finish_reason for r in reqs) and time.time() < deadline:
            time.sleep(0.02)
    finally:
        done.set()
        t.join()
        engine.stop()
    assert not errors and all(r.finish_reason for r in reqs)
    assert engine.counters["moved_cells"] > 0 and engine.pool.used() == engine.pool.cached_only()
    assert_each_equals_alone(rt_float, reqs, logits=False)


def test_metrics_expose_cells_bound_and_moved_cells(rt_float, monkeypatch):
    from edgekv.serve.metrics import Metrics
    monkeypatch.setattr(rt_float.backend, "past_bucket", 8)
    engine = rt_float.batcher(capacity=96, parallel=6, max_queue=64, prefill_chunk=8, max_prefixes=4)
    metrics = Metrics(engine)
    reqs, bound = [Request(ids(5 + (i * 7) % 13, 100 + i), 3 + (i * 5) % 9) for i in range(14)], []
    for r in reqs:
        engine.submit(r)
        engine.step()
        bound.append(engine.stats()["cells_bound"])
    while not all(r.finish_reason for r in reqs):
        engine.step()
    text = metrics.render()[0].decode()
    moved = engine.counters["moved_cells"]
    assert moved > 0 and f"edgekv_moved_cells_total {float(moved)}" in text
    assert "edgekv_cells_bound 0.0" in text  # idle: nothing bound, whatever the prefix cache holds
    assert 0 < max(bound) <= 96 and all(b % 8 == 0 for b in bound)
