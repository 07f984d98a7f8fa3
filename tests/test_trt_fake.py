"""The trt backend, the engine build and the self-test run their own logic against stand-ins for
TensorRT and cuda-python (tests/fake_gpu.py: host memory as "device" memory, the graph run by
onnxruntime at the addresses and shapes the backend set, inside the profile it selected)."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edgekv.runtime.backends import OrtBackend, make_backend
from edgekv.runtime.backends.base import Backend
from edgekv.runtime.memory import KVMemory
from edgekv.runtime.cache import KVCache
from edgekv.errors import EdgeKVError
from tests.stream_reference import Generator
from edgekv.format.bundle import load_bundle
from tests import fake_gpu
from tests.conftest import chat_engine


@pytest.fixture
def bundle_copy(tiny_bundle_int8, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(tiny_bundle_int8, dst)
    return dst


def ids(n, seed=0):
    return [int(x) for x in np.random.default_rng(seed).integers(3, 300, n)]


def test_build_engine_caches_and_the_trt_backend_matches_ort_cpu(bundle_copy, monkeypatch):
    trt, rt = fake_gpu.install(monkeypatch)
    from jetson.build_engine import build_engine

    folder = build_engine(str(bundle_copy), ctx=64, max_prefill=16)
    assert folder.name == "fake-orin-trt10.3.0-ctx64-p16" and (folder / "model.plan").is_file()
    meta = json.loads((folder / "engine.json").read_text())
    assert meta["ctx"] == 64 and meta["max_prefill"] == 16 and meta["gpu"] == "Fake Orin"
    assert build_engine(str(bundle_copy), ctx=64, max_prefill=16) == folder and trt.built == 1  # reused
    assert not list(folder.parent.glob(".*"))  # no temporary folder left behind

    b = load_bundle(bundle_copy)
    be = make_backend("trt", b, ctx=64, max_logits_rows=16)
    with make_backend("auto", b, ctx=64) as auto:
        assert be.name == "trt" and auto.name == "trt"
    assert isinstance(be, Backend) and isinstance(be.memory, KVMemory)  # it serves (run_cells)
    assert make_backend("auto", b, ctx=128).name == "ort-cpu"  # no engine covers a 128-slot cache
    g = Generator(be, KVCache(b, 64, memory=be.memory))
    assert g.prefill_chunk == 16  # prefill is cut to the engine's profile
    # past_bucket=1: ort-cpu binds exactly the filled slots, as the engine does, so the two sum in
    # the same order and must agree bit for bit (a bucketed past adds masked keys: ~1e-6 apart)
    ref = Generator(OrtBackend(b, threads=1, past_bucket=1, exact=False), KVCache(b, 64), prefill_chunk=16)
    seq = ids(40)
    got = [g.prefill(seq).copy()] + [g.decode_step(t).copy() for t in ids(8, 1)]
    want = [ref.prefill(seq).copy()] + [ref.decode_step(t).copy() for t in ids(8, 1)]
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
    all_rows = g.prefill(ids(12, 2), all_logits=True)  # eval's path: several logits rows per call
    np.testing.assert_array_equal(all_rows, ref.prefill(ids(12, 2), all_logits=True))
    # the cache lives in "device" memory and is read back through the memory interface
    snap = g.snapshot()
    np.testing.assert_array_equal(snap["past.0.key"], ref.cache.buffers["past.0.key"][: ref.seq.n])
    # close frees every device buffer (the KV cache's too) and the stream
    ptrs, stream = [buf.ptr for buf in be.memory.buffers], be.stream
    assert ptrs and all(p in rt.allocs for p in ptrs) and stream in rt.streams
    be.close()
    assert not any(p in rt.allocs for p in ptrs) and stream not in rt.streams


def test_trt_runs_a_wrapped_ring_through_staging(bundle_copy, monkeypatch):
    """A wrapped ring writes inside its own past; TensorRT may not overlap an input and an output
    (the stand-in asserts it), so the backend stages present.* and copies it on the device after
    the run: the same logits as ort-cpu bit for bit, and chat keeps its ring on trt."""
    fake_gpu.install(monkeypatch)
    from edgekv.chat.session import ChatSession
    from edgekv.runtime.sampling import SamplingParams
    from edgekv.runtime.text import TextCodec
    from jetson.build_engine import build_engine

    build_engine(str(bundle_copy), ctx=32, max_prefill=8)
    b = load_bundle(bundle_copy)
    be = make_backend("trt", b, ctx=32)
    from tests.ring_reference import RingGenerator, RingSequence  # a single stream's ring: the test-only oracle

    g = RingGenerator(be, KVCache(b, 32, memory=be.memory), RingSequence(32, b.max_context))
    ref = RingGenerator(OrtBackend(b, threads=1, past_bucket=1, exact=False), KVCache(b, 32), RingSequence(32, b.max_context),
                        prefill_chunk=8)
    for gen in (g, ref):
        gen.seq.enable_ring(2)
    seq = ids(30)
    np.testing.assert_array_equal(g.prefill(seq), ref.prefill(seq))
    for t in ids(12, 1):  # wraps after 2 steps, then overwrites its oldest slots
        np.testing.assert_array_equal(g.decode_step(t), ref.decode_step(t))
    assert g.seq.wrapped and g.seq.n == 32
    np.testing.assert_array_equal(g.prefill(ids(6, 2)), ref.prefill(ids(6, 2)))  # a staged prefill chunk
    # chat's ring on the engine, wrapping within its turns: the same replies on trt as on ort-cpu
    sessions = [ChatSession(b, TextCodec(b), chat_engine(backend, b, 32, 8), SamplingParams(), None, 8, context="ring")
                for backend in (be, OrtBackend(b, threads=1, exact=False))]
    for q in ("hello there", "and again, please", "once more"):
        assert sessions[0].reply(q)[0] == sessions[1].reply(q)[0]
    assert all(s.ring and s.seq.wrapped for s in sessions)
    # a turn interrupted after its calls overwrote ring cells: undone through the device memory's
    # row copies (CudaMemory reads row ranges), cells, ids and KV bytes as before the turn
    from tests.test_chat_engine import state
    s = sessions[0]
    assert s.batcher.cache.reads_rows
    before, calls, run = state(s), [0], be.run_cells

    def interrupted(*a):
        calls[0] += 1
        out = run(*a)
        if calls[0] == 3:
            raise KeyboardInterrupt
        return out
    monkeypatch.setattr(be, "run_cells", interrupted)
    text, stats = s.reply("and one more time")  # chat's reply catches the interrupt: "[stopped]"
    assert stats.stop_reason == "interrupted" and calls[0] == 3 and state(s) == before


def serve_on_trt_and_ort(bundle_copy, monkeypatch, schedule, max_steps, **engine_kw):
    """The same serving schedule (`schedule(engine)` submits and steps, returns its requests) on
    trt (stand-in) and on ort-cpu with the exact past, each run to its end: tokens and logits
    must be equal bit for bit. Per backend: (its requests, the engine's counters, whether its
    cache reads rows)."""
    fake_gpu.install(monkeypatch)
    from edgekv.runtime.assemble import Runtime
    from jetson.build_engine import build_engine

    build_engine(str(bundle_copy), ctx=64, max_prefill=16)
    b = load_bundle(bundle_copy)
    runs = {}
    for name, be in (("trt", make_backend("trt", b, ctx=64, max_logits_rows=16)),
                     ("ort", OrtBackend(b, threads=1, max_logits_rows=16, past_bucket=1, exact=False))):
        be.max_tokens_per_call = 16  # the engine's profile: the same calls on both (trt: already)
        engine = Runtime(b, be, 64).batcher(capacity=64, **engine_kw)
        reqs = schedule(engine)
        for _ in range(max_steps):
            if all(r.finish_reason for r in reqs):
                break
            engine.step()
        runs[name] = (reqs, dict(engine.counters), engine.cache.reads_rows)
        be.close()
    trt, ort = runs["trt"][0], runs["ort"][0]
    assert [r.out for r in trt] == [r.out for r in ort]
    assert [len(r.logits) for r in trt] == [len(r.logits) for r in ort]
    for a, b_ in zip(trt, ort):
        for got, want in zip(a.logits, b_.logits):
            np.testing.assert_array_equal(got, want)
    return runs


def test_trt_serves_a_churning_pool_exactly_as_ort_cpu(bundle_copy, monkeypatch):
    """The serving engine on trt (run_cells): many short requests in a small pool, so the pool is
    compacted (cells moved through the device memory's own move); tokens and logits equal the
    engine on ort-cpu bit for bit."""
    from edgekv.runtime.batching import Request

    def schedule(engine):
        reqs = [Request(ids(4 + (i * 5) % 11, 50 + i), 2 + (i * 3) % 7, record_logits=True) for i in range(12)]
        for r in reqs:
            engine.submit(r)
            engine.step()
        return reqs
    runs = serve_on_trt_and_ort(bundle_copy, monkeypatch, schedule, 500, parallel=5, prefill_chunk=16, max_prefixes=3)
    assert all(r.out for r in runs["trt"][0])
    for _, counters, reads_rows in runs.values():
        assert counters["moved_cells"] > 0 and reads_rows


def test_selftest_passes_with_a_working_trt(bundle_copy, monkeypatch, tmp_path, capsys):
    fake_gpu.install(monkeypatch)
    from jetson.selftest import main

    report = tmp_path / "r.json"
    assert main([str(bundle_copy), "--ctx", "256", "--skip-bench", "--report", str(report)]) == 0
    d = json.loads(report.read_text())
    trt = next(r for r in d["bundles"][0]["parity"] if r["backend"] == "trt")
    # the self-test's ort-cpu reference binds a bucketed past (masked tail keys change the float
    # summation order by ~1e-6); an address or layout bug is off by orders of magnitude more
    assert d["passed"] and trt["status"] == "pass" and trt["max_abs_logit_diff"] < 1e-5
    serve = d["bundles"][0]["serve"]  # the serving engine on trt: every joining sequence as alone
    assert serve["status"] == "pass" and all(r["first_divergence"] is None for r in serve["sequences"])
    assert serve["decode_tps_1"] > 0 and serve["decode_tps_4"] > 0
    out = capsys.readouterr().out
    assert "✓ trt" in out and "✓ serve on trt" in out


def test_build_engine_refuses_when_memory_is_short(bundle_copy, monkeypatch):
    _, rt = fake_gpu.install(monkeypatch)
    monkeypatch.setattr(rt, "cudaMemGetInfo", lambda: (fake_gpu.OK, 1 << 20, 16 << 30))
    from jetson.build_engine import build_engine

    with pytest.raises(EdgeKVError, match="MiB free"):
        build_engine(str(bundle_copy), ctx=64)
    assert not (bundle_copy / "engines").exists() or not any((bundle_copy / "engines").iterdir())


def test_selftest_checks_every_bundle_it_is_given(bundle_copy, monkeypatch, tmp_path):
    """The owner passes the float-weights and the int4-weights bundle: each gets its own engine
    and parity rows, and the run passes only if both do."""
    fake_gpu.install(monkeypatch)
    from jetson.selftest import main

    second = tmp_path / "second"
    shutil.copytree(bundle_copy, second)
    report = tmp_path / "r.json"
    assert main([str(bundle_copy), str(second), "--ctx", "96", "--skip-bench", "--report", str(report)]) == 0
    d = json.loads(report.read_text())
    assert [b["bundle"] for b in d["bundles"]] == [str(bundle_copy), str(second)]
    assert [Path(b["engine"]).parent.name for b in d["bundles"]] == ["engines", "engines"]
    assert [Path(b["engine"]).parents[1] for b in d["bundles"]] == [bundle_copy, second]
    assert all(any(r["backend"] == "trt" and r["status"] == "pass" for r in b["parity"]) for b in d["bundles"])
    (second / "edgekv.json").write_text("{}")  # a broken second bundle fails the run
    assert main([str(bundle_copy), str(second), "--ctx", "96", "--skip-bench", "--report", str(report)]) == 1


def test_device_memory_copies_row_ranges_and_refuses_rows_outside(monkeypatch):
    fake_gpu.install(monkeypatch)
    from edgekv.runtime.backends.gpu import CudaMemory
    mem = CudaMemory()
    buf = mem.alloc((10, 1, 3, 4), np.int8)
    rows = np.arange(10 * 12, dtype=np.int64).reshape(10, 1, 3, 4).astype(np.int8)
    mem.write(buf, rows)
    np.testing.assert_array_equal(mem.read_rows(buf, 3, 7), rows[3:7])
    mem.write_rows(buf, 6, rows[:4])
    want = rows.copy()
    want[6:10] = rows[:4]
    np.testing.assert_array_equal(mem.read(buf, 10), want)
    src, dst = np.array([2, 7, 8]), np.array([7, 2, 5])  # a swap and a move
    mem.move_rows(buf, src, dst)
    want[dst] = want[src].copy()
    np.testing.assert_array_equal(mem.read(buf, 10), want)
    for bad in (lambda: mem.read_rows(buf, 8, 11), lambda: mem.write_rows(buf, 8, rows[:3]),
                lambda: mem.write_rows(buf, 0, rows[:2, :, :2])):
        with pytest.raises(EdgeKVError):
            bad()
    mem.close()


def test_trt_serving_with_prefix_reuse_and_compaction_equals_ort_cpu(bundle_copy, monkeypatch):
    """Conversations cached, moved to the top, reused (moved down), cancelled mid-prefill and
    mid-decode: trt (stand-in) gives ort-cpu's tokens and logits bit for bit."""
    from edgekv.runtime.batching import Request

    def schedule(engine):
        rng = np.random.default_rng(3)
        reqs, convs = [], []
        for i in range(40):
            if convs and rng.random() < 0.5:
                prompt = (convs[int(rng.integers(len(convs)))] + ids(3, 900 + i))[:40]
            else:
                prompt = ids(int(rng.integers(2, 20)), 50 + i)
            reqs.append(engine.submit(Request(prompt, int(rng.integers(1, 8)), record_logits=True)))
            engine.step()
            if i % 7 == 3:
                engine.cancel(reqs[-2])
            engine.step()
            convs += [r.prompt + r.out for r in reqs if r.finish_reason == "length" and r.prompt + r.out not in convs]
        return reqs
    runs = serve_on_trt_and_ort(bundle_copy, monkeypatch, schedule, 2000, parallel=4, prefill_chunk=5, max_prefixes=4)
    counters = runs["trt"][1]
    assert counters["moved_cells"] > 0 and counters["reused_tokens"] > 0
