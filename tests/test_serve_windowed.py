"""`edgekv serve`'s windowed pool (docs/serve.md, "Windowed KV"): Gemma 3's local layers keep a
ring of their window per running request (W - 1 + SERVE_MARGIN slots), the global layers keep
cells, and the prefix cache keeps a copy of a ring beside each entry, reusing it only where that
copy holds the window before the match. Oracles: each request alone through the full cache
(the generator over KVCache(windowed=False)), and the same requests without the prefix cache.
The tiny checkpoint's window is 8 (7 local slots); every prompt and reply runs past it."""
from __future__ import annotations

import json
import re
import urllib.request

import numpy as np
import pytest

from edgekv.cli import explain
from edgekv.errors import EdgeKVError
from edgekv.format.bundle import load_bundle
from edgekv.runtime.assemble import SERVE_MARGIN, open_runtime, serve_pool
from edgekv.runtime.backends import OrtBackend
from edgekv.runtime.batching import Batcher, Request
from edgekv.runtime.cache import KVCache
from tests.stream_reference import Generator
from edgekv.serve.server import WINDOW_AUTO, kv_summary, make_batcher, serve_layout
from tests.archs import GEMMA_PARITY_STEPS
from tests.conftest import cli
from tests.serving import built, run_until_done, staggered

CONTEXT = 128  # the bundles' verified context (test_gemma3's: the same exports)
WINDOW = 8
RING = WINDOW - 1 + SERVE_MARGIN


def ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 380, n)]


@pytest.fixture(scope="module")
def bundles(arch_bundles):
    return lambda kv: arch_bundles("gemma3", kv, CONTEXT, steps=GEMMA_PARITY_STEPS)


def alone_full(b, prompt, n):
    """Greedy tokens and their logits, one sequence through the full cache (every position)."""
    g = Generator(OrtBackend(b, threads=1), KVCache(b, CONTEXT), prefill_chunk=8)
    assert g.cache.local_ring is None
    logits = g.prefill(prompt).copy()
    toks, rows = [], []
    for _ in range(n):
        rows.append(logits)
        toks.append(int(np.argmax(logits)))
        if len(toks) < n:
            logits = g.decode_step(toks[-1]).copy()
    return toks, np.stack(rows)


def assert_alone(b, req, exact_logits=True):
    toks, rows = alone_full(b, req.prompt, len(req.out))
    assert req.out == toks
    if exact_logits:
        np.testing.assert_allclose(np.stack(req.logits), rows, atol=1e-4, rtol=1e-4)


def windowed_pool(b, rings, parallel=4, prefixes=None, chunk=8):
    """serve's windowed pool built by hand: `rings` rings of serve's length (the product's rule,
    serve_pool, takes the ring only where it is smaller: at CONTEXT, for two)."""
    cache = KVCache(b, CONTEXT, windowed=True, rings=rings, margin=SERVE_MARGIN)
    return Batcher(OrtBackend(b, threads=1), cache, parallel=parallel, prefill_chunk=chunk,
                   max_prefixes=rings if prefixes is None else prefixes)


def serve_engine(b, parallel=2, window=WINDOW_AUTO, chunk=8):
    """The batcher `edgekv serve` builds for the cell pool (server.make_batcher, not started); `window`:
    Layout's (None: --full-kv; N: --prefix-windows N)."""
    rt = open_runtime(b.path, CONTEXT, "ort-cpu", threads=1)
    return make_batcher(rt, serve_layout(rt, 0, parallel, CONTEXT, window), parallel, prefill_chunk=chunk)


# -- what serve builds ------------------------------------------------------------------------

def test_serve_takes_the_windowed_pool_where_it_is_smaller_and_says_so(bundles):
    """--slots 0 on ort-cpu's graph as written: a ring per running request and the prefix cache
    capped at as many windows; --full-kv, or rings and copies not smaller than the cells: every
    position. The load line and the stats report the windowed bytes."""
    b = load_bundle(bundles("int8"))
    e = serve_engine(b, parallel=2)
    cache = e.cache
    assert (cache.local_ring, cache.rings, e.parallel, e.pool.max_prefixes) == (RING, 2, 2, 2)
    full = KVCache(b, CONTEXT)
    assert cache.nbytes == CONTEXT * cache.bytes_per_token + 2 * RING * cache.local_row < full.nbytes
    st = e.stats()
    assert (st["kv_bytes"], st["kv_local_rings"], st["kv_prefix_window_bytes"]) == (cache.nbytes, 2, 0)
    line = kv_summary(e, b)
    assert f"+ 2 rings of {RING} cells" in line and f"--full-kv: every position, {full.nbytes / 2**20:.1f} MiB" in line
    # the prefix cache's copies as many as fit with the rings under the full pool: (rings + copies) * 23 < 128
    three, five = serve_engine(b, parallel=3), serve_engine(b, parallel=5)
    assert (three.cache.rings, three.pool.max_prefixes, five.cache.rings, five.pool.max_prefixes) == (3, 2, 5, 0)
    assert "up to 2 window copies" in kv_summary(three, b) and "no prefix cache" in kv_summary(five, b)
    for other in (serve_engine(b, parallel=2, window=None), serve_engine(b, parallel=6)):  # 6 * 23 > 128
        assert other.cache.local_ring is None and other.cache.nbytes == full.nbytes
        assert other.pool.max_prefixes == 32 and other.stats()["kv_local_rings"] == 0
        assert "every position" in kv_summary(other, b)


def test_prefix_windows_chooses_the_copies_and_too_many_is_one_line(bundles):
    """--prefix-windows N: the prefix cache keeps N window copies (0: none); more than leave the
    pool under the full one's bytes is refused with one line (before any request), as is asking
    for copies together with --full-kv."""
    b = load_bundle(bundles("float"))
    for n in (0, 1, 3):  # 2 rings: (2 + 3) * 23 < 128
        e = serve_engine(b, parallel=2, window=n)
        assert e.cache.local_ring == RING and e.pool.max_prefixes == n
    with pytest.raises(EdgeKVError) as e:
        serve_engine(b, parallel=2, window=4)
    assert re.fullmatch(r"4 window copies: 2 rings and 4 window copies .* \(at most 3 here: --prefix-windows 3\)",
                        explain(e.value))
    with pytest.raises(EdgeKVError) as e:
        serve_engine(b, parallel=6, window=0)
    assert re.fullmatch(r"0 window copies: 6 rings of 23 cells .* \(the rings alone fill it: .*\)", explain(e.value))
    r = cli("serve", b.path, "--full-kv", "--prefix-windows", "1", "--port", "0")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == ["edgekv serve: error: --prefix-windows counts a windowed pool's copies; "
                                             "--full-kv keeps every position: give one of them"]


# -- batched = alone through the full cache ----------------------------------------------------

@pytest.mark.parametrize("kv", ["float", "int8"])
def test_concurrent_requests_through_the_windowed_pool_equal_each_alone(bundles, kv):
    """tests/serving.py's staggered schedule (A alone, B joins, C's long prompt prefilled beside
    their decodes, D after B left) over four rings: each request = itself alone through the full
    cache, past the window many times (float: logits to 1e-4; int8: greedy tokens)."""
    b = load_bundle(bundles(kv))
    e = windowed_pool(b, rings=4, prefixes=0)
    spec = {"A": (ids(9, 1), 30), "B": (ids(12, 2), 10), "C": (ids(33, 3), 20), "D": (ids(10, 4), 24)}
    run = staggered(e, spec, prefill_steps=4)
    assert run.mixed
    for name, (prompt, n) in spec.items():
        req = run.reqs[name]
        assert len(req.out) == n and len(prompt) + n > 2 * WINDOW, name
        assert_alone(b, req, exact_logits=kv == "float")
    assert len(e.kv.window_rings.free) == 4 and not e.kv.sequences  # every ring back with its request


def test_admission_waits_for_a_free_ring_not_only_for_cells(bundles):
    """Two rings, four requests allowed and cells for all: two run, the others wait (no
    error) until a request gives its ring back, then run the same as alone."""
    b = load_bundle(bundles("float"))
    e = windowed_pool(b, rings=2, parallel=4, prefixes=0)
    assert e.parallel == 2
    reqs = [Request(ids(10, 20 + i), 12 + 4 * i, record_logits=True) for i in range(3)]
    for r in reqs:
        e.submit(r)
    e.step()
    assert len(e.running) == 2 and len(e.waiting) == 1 and e.pool.free() > 64
    assert not e.kv.window_rings.free
    while not reqs[0].finish_reason:
        e.step()
        assert len(e.running) <= 2
    e.step()
    assert reqs[2].seq is not None and reqs[2] in e.running  # it took the first request's ring
    run_until_done(e, reqs)
    for r in reqs:
        assert_alone(b, r)
    assert sorted(e.kv.window_rings.free) == [0, 1]


def test_a_preempted_request_resumes_through_a_ring_the_same_as_alone(bundles):
    """Two requests whose replies outgrow the pool's 128 cells: the younger is preempted (its ring
    given back), readmitted with a ring and its prompt's cached window, and both equal alone."""
    b = load_bundle(bundles("float"))
    e = windowed_pool(b, rings=2)
    reqs = [Request(ids(20, 70 + i), 60, record_logits=True) for i in range(2)]
    for r in reqs:
        e.submit(r)
    run_until_done(e, reqs)
    assert e.counters["preempted"] >= 1
    for r in reqs:
        assert len(r.out) == 60
        assert_alone(b, r)
    assert sorted(e.kv.window_rings.free) == [0, 1]


# -- the prefix cache --------------------------------------------------------------------------

def conversation(e, first, second):
    """Turn 1 (`first`), then turn 2 sending it back with its whole reply and `second`, then
    turn 2's prompt again (a retry): the three requests."""
    r1 = Request(first, 14, record_logits=True)
    e.submit(r1)
    run_until_done(e, [r1])
    r2 = Request(first + r1.out + second, 10, record_logits=True)
    e.submit(r2)
    run_until_done(e, [r2])
    r3 = Request(list(r2.prompt), 10, record_logits=True)
    e.submit(r3)
    run_until_done(e, [r3])
    return r1, r2, r3


def test_a_cached_prefix_is_reused_with_its_window_and_equals_no_cache(bundles):
    """A conversation's next turn takes the finished turn's cells and its ring's copy (the
    match ends where the entry does); a retried prompt takes them too (its match stops one
    short, within the margin): the replies and logits of the same requests without the prefix
    cache, and of each alone. The copies' bytes are reported."""
    b = load_bundle(bundles("float"))
    first, second = ids(20, 40), ids(9, 41)
    cached = windowed_pool(b, rings=2)
    got = conversation(cached, first, second)
    want = conversation(windowed_pool(b, rings=2, prefixes=0), first, second)
    r1, r2, r3 = got
    assert r2.reused == len(first) + len(r1.out) - 1  # the finished turn: all it fed
    assert r3.reused == len(r3.prompt) - 1  # the whole prompt but its last token
    assert cached.counters["reused_tokens"] == r2.reused + r3.reused
    assert all(w.reused == 0 for w in want)
    for g, w in zip(got, want):
        assert g.out == w.out
        np.testing.assert_allclose(np.stack(g.logits), np.stack(w.logits), atol=1e-5, rtol=1e-5)
        assert_alone(b, g)
    ring_row = cached.cache.local_row
    assert cached.stats()["kv_prefix_window_bytes"] == len(cached.pool.prefixes) * RING * ring_row > 0


def test_an_entry_evicted_for_admission_takes_its_window_copy_with_it(bundles):
    """Two finished requests cached (their cells and copies); a long prompt's admission evicts
    them to make room: their copies go at once, not at the next entry kept (the bytes /health
    reports and the host memory they hold)."""
    b = load_bundle(bundles("float"))
    e = windowed_pool(b, rings=2)
    for i in range(2):
        r = Request(ids(20, 60 + i), 14)
        e.submit(r)
        run_until_done(e, [r])
    assert len(e.pool.prefixes) == 2 and len(e.kv.windows.saved) == 2
    long = Request(ids(100, 62), 8)
    e.submit(long)
    e.step()  # admitted (the cached entries evicted for its cells), its prompt not yet all in
    assert long.seq is not None and long.reused == 0 and len(e.pool.prefixes) < 2
    assert set(e.kv.windows.saved) <= set(e.pool.prefixes)
    assert e.stats()["kv_prefix_window_bytes"] == sum(w.nbytes for w in e.kv.windows.saved.values())
    run_until_done(e, [long])
    assert_alone(b, long, exact_logits=False)


def test_a_match_the_window_copy_does_not_cover_is_prefilled(bundles):
    """A shared first part (a system prompt) before a different question: the entry's copy holds
    the window before the entry's end, not before the match, so nothing is reused, and the reply
    is the one alone. The prefix cache never keeps more entries (copies) than it has rings."""
    b = load_bundle(bundles("float"))
    e = windowed_pool(b, rings=2)
    system = ids(30, 50)
    # each entry ends 6 + 19 tokens after the shared part: beyond the SERVE_MARGIN its copy covers
    reqs = [Request(system + ids(6, 51 + i), 20, record_logits=True) for i in range(4)]
    for r in reqs:
        e.submit(r)
        run_until_done(e, [r])
        assert r.reused == 0
        assert_alone(b, r)
        assert len(e.pool.prefixes) <= 2 and set(e.kv.windows.saved) <= set(e.pool.prefixes)
    assert e.stats()["kv_prefix_window_bytes"] == sum(w.nbytes for w in e.kv.windows.saved.values())


def test_concurrent_requests_share_a_cached_prefix_as_no_cache(bundles):
    """The product's pool (serve's engine, two rings): two requests continuing the same finished
    turn, admitted together, both take its cells and a copy of its window into their own rings."""
    b = load_bundle(bundles("float"))
    e = serve_engine(b, parallel=2)
    assert e.cache.local_ring == RING
    head = Request(ids(18, 60), 12)
    e.submit(head)
    run_until_done(e, [head])
    base = head.prompt + head.out
    pair = [Request(base + ids(5, 61 + i), 12, record_logits=True) for i in range(2)]
    for r in pair:
        e.submit(r)
    run_until_done(e, pair)
    for r in pair:
        assert r.reused == len(base) - 1
        assert_alone(b, r)


# -- the HTTP layer ----------------------------------------------------------------------------

def test_health_and_metrics_report_the_windowed_bytes(bundles):
    """`edgekv serve`'s app over the windowed pool: /health and /metrics carry its bytes and rings,
    and a completion runs through it."""
    b = load_bundle(bundles("float"))
    with open_runtime(b.path, CONTEXT, "ort-cpu", threads=1) as rt, \
            built(rt, ctx=CONTEXT, parallel=2, max_queue=4, prefill_chunk=8) as (_, e, url):
        body = json.dumps({"model": "m", "prompt": "hello there, how are you", "max_tokens": 20,
                           "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and json.load(r)["usage"]["completion_tokens"] >= 1
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            health = json.load(r)
        assert health["kv_bytes"] == e.cache.nbytes < KVCache(b, CONTEXT).nbytes
        assert health["kv_local_rings"] == 2 and health["kv_prefix_window_bytes"] > 0
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert f"edgekv_kv_bytes {float(e.cache.nbytes)}" in text and "edgekv_kv_local_rings 2.0" in text
