"""Backend selection and its errors, the cache's memory interface, engine profiles and cache keys.

The GPU backends (ort-cuda, trt) cannot run here; what can be checked without a GPU is: the
pointer-only path they use (a cache in memory the backend may only address, never index),
their one-line errors, `auto`, and the TensorRT profiles against the graph's inputs. The tests
that need a GPU are at the end and skip with the reason."""
import json

import numpy as np
import onnx
import pytest

from edgekv.errors import BackendUnavailable
from edgekv.runtime.backends import OrtBackend, make_backend
from edgekv.runtime.cache import KVCache
from edgekv.runtime.backends.engines import (META, PLAN, PROFILES_VERSION, bundle_fingerprint, engine_key, find_engine,
                                             profile_shapes)
from edgekv.errors import EdgeKVError
from tests.stream_reference import Generator
from edgekv.format.bundle import load_bundle
from tests.conftest import run_edgekv


class Opaque:
    def __init__(self, arr):
        self._arr = arr  # private: like device memory, reachable only by address


class OpaqueMemory:
    """Host memory that behaves like device memory: the backend gets addresses, never arrays."""
    device = "cpu"
    slots = 1

    def free_bytes(self):
        return None

    def alloc(self, shape, dtype):
        return Opaque(np.zeros(shape, dtype))

    def ptr(self, buf):
        return buf._arr.ctypes.data

    def read(self, buf, n):
        return buf._arr[:n].copy()

    def write(self, buf, arr):
        buf._arr[: len(arr)] = arr


def ids(n, seed=0):
    return [int(x) for x in np.random.default_rng(seed).integers(3, 300, n)]


@pytest.mark.parametrize("fixture", ["tiny_bundle_int8", "tiny_bundle_float"])
def test_pointer_only_cache_gives_the_same_logits(fixture, request):
    b = load_bundle(request.getfixturevalue(fixture))
    be = OrtBackend(b, threads=1, max_logits_rows=8)
    host = Generator(be, KVCache(b, 64), prefill_chunk=5)
    opaque = Generator(be, KVCache(b, 64, memory=OpaqueMemory()), prefill_chunk=5)
    seq = ids(12)
    a = [host.prefill(seq).copy()] + [host.decode_step(t).copy() for t in ids(6, 1)]
    o = [opaque.prefill(seq).copy()] + [opaque.decode_step(t).copy() for t in ids(6, 1)]
    np.testing.assert_array_equal(np.stack(a), np.stack(o))
    # snapshot/restore go through read/write too
    snap = opaque.snapshot()
    for name, arr in snap.items():
        np.testing.assert_array_equal(arr, host.cache.buffers[name][:18])
    fresh = Generator(be, KVCache(b, 64, memory=OpaqueMemory()))
    fresh.restore(snap, opaque.seq.ids)
    assert fresh.seq.n == 18
    for name in snap:
        np.testing.assert_array_equal(fresh.cache.memory.read(fresh.cache.buffers[name], 18), snap[name])


def test_ortvalue_memory_runs_the_ort_cuda_path_on_the_cpu(tiny_bundle_int8):
    """ort-cuda keeps the cache in OrtValues; the same class on the CPU must give the same logits."""
    import onnxruntime as ort

    from edgekv.runtime.backends.base import Backend
    from edgekv.runtime.backends.gpu import OrtValueMemory
    from edgekv.runtime.memory import KVMemory, RowMemory

    b = load_bundle(tiny_bundle_int8)
    be = OrtBackend(b, threads=1)
    assert isinstance(be, Backend)  # every member of the protocol is there
    assert isinstance(be.memory, RowMemory) and not isinstance(OpaqueMemory(), RowMemory)
    assert all(isinstance(m, KVMemory) for m in (be.memory, OrtValueMemory(ort, "cpu"), OpaqueMemory()))
    host = Generator(be, KVCache(b, 32))
    ov = Generator(be, KVCache(b, 32, memory=OrtValueMemory(ort, "cpu")))
    a = [host.prefill(ids(9)).copy()] + [host.decode_step(t).copy() for t in ids(4, 2)]
    o = [ov.prefill(ids(9)).copy()] + [ov.decode_step(t).copy() for t in ids(4, 2)]
    np.testing.assert_array_equal(np.stack(a), np.stack(o))
    snap = ov.snapshot()
    fresh = KVCache(b, 32, memory=OrtValueMemory(ort, "cpu"))
    fresh.write(snap)
    for name in snap:
        np.testing.assert_array_equal(fresh.memory.read(fresh.buffers[name], 13), host.cache.buffers[name][:13])


def test_cache_slot_addresses_follow_the_layout(tiny_bundle_int8):
    b = load_bundle(tiny_bundle_int8)
    c = KVCache(b, 32)
    for name, buf in c.buffers.items():
        assert c.ptr(name, 0) == buf.ctypes.data
        assert c.ptr(name, 7) == buf[7:].ctypes.data
        assert c.slots_shape(name, 3) == list(buf[:3].shape)


def test_backend_and_cache_memory_must_agree(tiny_bundle_int8):
    b = load_bundle(tiny_bundle_int8)
    be = OrtBackend(b, threads=1)

    class Elsewhere(OpaqueMemory):
        device = "cuda"

    g = Generator(be, KVCache(b, 16, memory=Elsewhere()))
    with pytest.raises(EdgeKVError, match="memory"):
        g.prefill(ids(3))


def test_gpu_backends_say_what_they_need(tiny_bundle_int8):
    import onnxruntime as ort

    b = load_bundle(tiny_bundle_int8)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(BackendUnavailable, match="onnxruntime-gpu"):
            make_backend("ort-cuda", b)
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match="TensorRT"):
            make_backend("trt", b)
    with pytest.raises(EdgeKVError, match="unknown backend"):
        make_backend("tpu", b)
    assert make_backend("auto", b).name in ("ort-cpu", "ort-cuda", "trt")


def test_cli_backend_errors_are_one_line(tiny_bundle_int8):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime here has CUDA: ort-cuda would run")
    r = run_edgekv("generate", tiny_bundle_int8, "hi", "--backend", "ort-cuda", "--max-new-tokens", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "onnxruntime-gpu" in r.stderr
    r = run_edgekv("build-engine", tiny_bundle_int8)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "TensorRT" in r.stderr
    r = run_edgekv("generate", tiny_bundle_int8, "hi", "--backend", "auto", "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("fixture", ["tiny_bundle_int8", "tiny_bundle_float"])
def test_engine_profiles_fit_the_graph(fixture, request):
    b = load_bundle(request.getfixturevalue(fixture))
    g = onnx.load(str(b.onnx_path), load_external_data=False).graph
    ctx, max_prefill = 64, 16
    decode, prefill = profile_shapes(b, ctx, max_prefill)
    for prof in (decode, prefill):
        assert set(prof) == {i.name for i in g.input}  # every input has shapes, nothing else
        for inp in g.input:
            dims = inp.type.tensor_type.shape.dim
            lo, opt, hi = prof[inp.name]
            assert len(lo) == len(opt) == len(hi) == len(dims), inp.name
            for j, d in enumerate(dims):
                assert lo[j] <= opt[j] <= hi[j]
                if d.HasField("dim_value"):  # static dims must be exactly the graph's
                    assert lo[j] == opt[j] == hi[j] == d.dim_value, (inp.name, j)
        # the graph's key_mask is [1, S, P + S]: every corner of the box must say so
        past0 = next(n for n in prof if n.startswith("past."))
        for c in range(3):
            assert prof["key_mask"][c][1] == prof["input_ids"][c][1]
            assert prof["key_mask"][c][2] == prof[past0][c][0] + prof["input_ids"][c][1]
        assert prof[past0][2][0] == ctx  # the past reaches the capacity (a full pool or ring: every slot)
    assert decode["input_ids"] == ((1, 1),) * 3 and prefill["input_ids"][2] == (1, max_prefill)


def test_engine_cache_is_keyed_and_goes_stale(tiny_bundle_int8, tmp_path):
    import shutil

    src = load_bundle(tiny_bundle_int8)
    copy = tmp_path / "bundle"
    shutil.copytree(src.path, copy)
    b = load_bundle(copy)
    key = engine_key("Orin (nvgpu)", "10.3.0", 512, 256)
    assert key == "orin-nvgpu-trt10.3.0-ctx512-p256"
    folder = copy / "engines" / key
    folder.mkdir(parents=True)
    (folder / PLAN).write_bytes(b"plan")
    meta = {"bundle_fingerprint": bundle_fingerprint(b), "ctx": 512, "max_prefill": 256}
    (folder / META).write_text(json.dumps(meta))
    assert find_engine(b, "Orin (nvgpu)", "10.3.0", 256) is None  # built before the profiles reached ctx
    (folder / META).write_text(json.dumps({**meta, "profiles_version": PROFILES_VERSION}))
    assert find_engine(b, "Orin (nvgpu)", "10.3.0", 256)[0] == folder  # covers a smaller cache
    assert find_engine(b, "Orin (nvgpu)", "10.3.0", 1024) is None  # not a larger one
    assert find_engine(b, "Orin (nvgpu)", "10.4.0", 256) is None  # nor another TensorRT
    assert find_engine(b, "H200", "10.3.0", 256) is None  # nor another GPU
    man = json.loads((copy / "edgekv.json").read_text())
    man["exported_by"] = "a re-export"
    (copy / "edgekv.json").write_text(json.dumps(man))
    assert find_engine(load_bundle(copy), "Orin (nvgpu)", "10.3.0", 256) is None  # the bundle changed: stale


def _cuda_skip_reason():
    try:
        from edgekv.runtime.backends.gpu import CudaMemory
        CudaMemory().free_bytes()
    except Exception as e:  # no cuda-python, or no GPU
        return f"needs cuda-python and a CUDA GPU ({str(e).splitlines()[0][:80]}); jetson/selftest.sh runs it on the device"
    return None


@pytest.mark.skipif(_cuda_skip_reason() is not None, reason=str(_cuda_skip_reason()))
def test_cuda_memory_slots_round_trip(tiny_bundle_int8):
    from edgekv.runtime.backends.gpu import CudaMemory

    b = load_bundle(tiny_bundle_int8)
    c = KVCache(b, 32, memory=CudaMemory())
    rng = np.random.default_rng(0)
    snap = {n: rng.integers(-127, 127, c.slots_shape(n, 9)).astype(c.dtypes[n]) for n in c.names}
    c.restore(snap)
    for n in c.names:
        np.testing.assert_array_equal(c.snapshot()[n], snap[n])
        assert c.ptr(n, 5) - c.ptr(n, 0) == 5 * c.row_bytes[n]


def _ort_cuda_skip_reason():
    import onnxruntime as ort
    return None if "CUDAExecutionProvider" in ort.get_available_providers() else \
        "needs onnxruntime-gpu with CUDA; jetson/selftest.sh runs it on the device"


@pytest.mark.skipif(_ort_cuda_skip_reason() is not None, reason=str(_ort_cuda_skip_reason()))
def test_ort_cuda_matches_ort_cpu(tiny_bundle_int8):
    b = load_bundle(tiny_bundle_int8)
    out = []
    for name in ("ort-cpu", "ort-cuda"):
        be = make_backend(name, b)
        g = Generator(be, KVCache(b, 64, memory=be.memory))
        out.append(np.stack([g.prefill(ids(12)).copy()] + [g.decode_step(t).copy() for t in ids(6, 1)]))
    np.testing.assert_allclose(out[1], out[0], atol=2e-3)


def test_tegrastats_lines_are_read():
    from jetson.selftest import parse_tegrastats

    nano = ("RAM 2448/7620MB (lfb 6x4MB) SWAP 0/3810MB (cached 0MB) CPU [2%@729,0%@729] GR3D_FREQ 0% "
            "cpu@47.5C VDD_IN 4937mW/4937mW VDD_CPU_GPU_CV 593mW/593mW VDD_SOC 1383mW/1383mW")
    agx = "RAM 5120/30536MB (lfb 10x4MB) CPU [1%@2201] VDD_GPU_SOC 2391mW/2391mW VIN_SYS_5V0 3519mW/3519mW"
    assert parse_tegrastats(nano) == {"ram_used_mib": 2448, "ram_total_mib": 7620, "power_mw": 4937}
    assert parse_tegrastats(agx)["power_mw"] == 3519
    assert parse_tegrastats("nothing here") == {}


def test_selftest_reports_what_it_could_not_check(tiny_bundle_int8, tmp_path):
    """The owner's one command, run here: no TensorRT, so it must fail visibly, say why, and still
    write the report with what it did check."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    rep = tmp_path / "report.json"
    r = subprocess.run(["bash", str(ROOT / "jetson" / "selftest.sh"), str(tiny_bundle_int8), "--ctx", "64",
                        "--skip-bench", "--report", str(rep)], capture_output=True, text=True, timeout=600,
                       env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here: the self-test would really build")
    except ImportError:
        pass
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr
    d = json.loads(rep.read_text())
    assert d["passed"] is False and d["env"]["onnxruntime"]
    trt = next(row for row in d["bundles"][0]["parity"] if row["backend"] == "trt")
    assert trt["status"] == "unavailable" and "TensorRT" in trt["why"]
    assert "== FAIL" in r.stdout


def test_cache_reads_run_as_cast_with_the_same_logits(tiny_bundle_int8, monkeypatch):
    """The ort backend runs the graph's unit-scale DequantizeLinear reads of the int8 cache as
    Cast (docs/graph.md): none is left, every one became a Cast, and the logits are bit-identical
    to the graph as written."""
    from edgekv.runtime.backends import ort as ort_mod

    b = load_bundle(tiny_bundle_int8)
    written = onnx.load(str(b.onnx_path), load_external_data=False).graph
    int8_inputs = {i.name for i in written.input if i.type.tensor_type.elem_type == onnx.TensorProto.INT8}
    dq_reads = [n for n in written.node if n.op_type == "DequantizeLinear" and n.input[0] in int8_inputs]
    assert int8_inputs and len(dq_reads) >= len(int8_inputs)
    g = onnx.load_from_string(ort_mod.cast_cache_reads(b.onnx_path)).graph
    assert not [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in int8_inputs]
    casts = [n for n in g.node if n.op_type == "Cast" and n.input[0] in int8_inputs]
    assert sorted(n.output[0] for n in casts) == sorted(n.output[0] for n in dq_reads)
    assert all(a.i == onnx.TensorProto.FLOAT for n in casts for a in n.attribute if a.name == "to")

    def run(backend):
        gen = Generator(backend, KVCache(b, 64))
        rows = [gen.prefill(list(range(5, 30))).copy()]
        return np.stack(rows + [gen.decode_step(t).copy() for t in (7, 8, 9, 10)])

    cast = run(OrtBackend(b, threads=1))
    from edgekv.graph.passes import Changed
    from edgekv.graph.passes.cache_reads import CacheReads
    monkeypatch.setattr(CacheReads, "apply", lambda self, index: Changed(False))  # the reads as written
    as_written = run(OrtBackend(b, threads=1))
    np.testing.assert_array_equal(cast, as_written)


def test_only_unit_scalar_dq_reads_of_int8_inputs_become_casts(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    from edgekv.runtime.backends.ort import cast_cache_reads

    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half"),
             numpy_helper.from_array(np.array([1.0, 1.0], np.float32), "ones_axis"),
             numpy_helper.from_array(np.array(3, np.int8), "zp3"),
             numpy_helper.from_array(np.array([[1, 2], [3, 4]], np.int8), "w8")]
    nodes = [helper.make_node("DequantizeLinear", ["x", "one"], ["unit"]),
             helper.make_node("DequantizeLinear", ["x", "half"], ["scaled"]),
             helper.make_node("DequantizeLinear", ["x", "ones_axis"], ["per_axis"], axis=1),
             helper.make_node("DequantizeLinear", ["x", "one", "zp3"], ["shifted"]),
             helper.make_node("DequantizeLinear", ["w8", "one"], ["weight"])]  # not a graph input
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("unit", "scaled", "per_axis", "shifted", "weight")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.INT8, [2, 2])], outs, inits)
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    got = {n.output[0]: n.op_type for n in onnx.load_from_string(cast_cache_reads(path)).graph.node}
    assert got == {"unit": "Cast", "scaled": "DequantizeLinear", "per_axis": "DequantizeLinear",
                   "shifted": "DequantizeLinear", "weight": "DequantizeLinear"}


@pytest.mark.parametrize("memory", ["host", "ortvalue", "opaque"])
def test_move_cells_is_a_simultaneous_copy_in_every_memory(tiny_bundle_int8, memory):
    """Compaction's copy: slot src[i] -> dst[i] with swaps and chains, every source read before
    any slot is written: host memory's and ort-cuda's OrtValues' own moves (on the CPU here), and
    the whole-buffer fallback of a memory that only reads from slot 0."""
    import onnxruntime as ort

    from edgekv.runtime.backends.gpu import OrtValueMemory
    from edgekv.runtime.memory import MovesRows
    b = load_bundle(tiny_bundle_int8)
    mem = {"host": None, "ortvalue": OrtValueMemory(ort, "cpu"), "opaque": OpaqueMemory()}[memory]
    cache = KVCache(b, 40, memory=mem)
    rng = np.random.default_rng(7)
    before = {}
    for name, buf in cache.buffers.items():
        vals = rng.integers(-100, 100, cache.shapes[name]).astype(cache.dtypes[name])
        cache.memory.write(buf, vals)
        before[name] = vals
    perm = np.arange(40)
    perm[[3, 9, 20, 21, 30]] = [9, 3, 30, 20, 21]  # a swap and a 3-cycle
    src = np.flatnonzero(perm != np.arange(40))
    assert isinstance(cache.memory, MovesRows) == (memory != "opaque")
    cache.move_cells(src, perm[src])
    for name, buf in cache.buffers.items():
        want = before[name].copy()
        want[perm[src]] = before[name][src]
        np.testing.assert_array_equal(cache.memory.read(buf, 40), want)


def test_ort_cuda_runs_the_graph_as_written_and_says_why(tiny_bundle_float, monkeypatch):
    """ort-cuda does not fuse a float32 graph (CUDA's GroupQueryAttention runs float16 graphs;
    docs/fused.md, tests/test_fused_cuda.py for the float16 ones): its class on the CPU provider
    keeps the graph as written under auto with the reason in its load line, and
    EDGEKV_ATTENTION=fused there is one line, not a silent plain run."""
    from edgekv.runtime.backends.fused import ATTENTION_ENV
    from tests.fake_gpu import cuda_on_cpu

    OnCpu = cuda_on_cpu()  # ort-cuda's own choices, run by the CPU provider

    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    b = load_bundle(tiny_bundle_float)
    be = OnCpu(b, threads=1, attention="auto")
    assert be.fused is None and "ort-cuda" in be.attention and "float32" in be.attention, be.attention
    assert "key_mask" in {i.name for i in be.session.get_inputs()}
    with pytest.raises(BackendUnavailable, match="ort-cuda"):
        OnCpu(b, threads=1, attention="fused")


def test_memories_scatter_rows_as_their_row_copies_do():
    """write_slots (a ring's scattered writes, KVCache.write_local) = write_rows one slot at a time,
    in each host layout (slot-major, head-major: the fused graph's, serve's slots: one numpy
    scatter) and in ort-cuda's OrtValue memories on the CPU (a copy per run of slots)."""
    import onnxruntime as ort

    from edgekv.runtime.backends.gpu import OrtValueHeadMajorMemory, OrtValueSlotMemory
    from edgekv.runtime.memory import HeadMajorMemory, HostMemory, RowMemory, SlotMemory

    rng = np.random.default_rng(0)
    for memory in (HostMemory(), HeadMajorMemory(spare=2), SlotMemory(2),
                   OrtValueHeadMajorMemory(ort, "cpu", 2), OrtValueSlotMemory(ort, "cpu", 2)):
        assert isinstance(memory, RowMemory)
        buf, ref = memory.alloc((8, 1, 3, 4), np.float32), memory.alloc((8, 1, 3, 4), np.float32)
        slots, rows = np.array([5, 1, 2, 6, 7]), rng.random((5, 1, 3, 4)).astype(np.float32)  # runs of 1, 2, 2
        memory.write_slots(buf, slots, rows)
        for s, r in zip(slots, rows):
            memory.write_rows(ref, int(s), r[None])
        np.testing.assert_array_equal(memory.read(buf, 8), memory.read(ref, 8), err_msg=type(memory).__name__)
        assert np.abs(memory.read(buf, 8)).sum() > 0


def test_write_cells_puts_each_snapshot_row_at_its_cell(tiny_bundle_float):
    """KVCache.write_cells (a restored snapshot: /load, the prompt cache, serve's prefixes): row i
    of the snapshot lands in cell cells[i] and nothing else changes, in every memory: the host
    layouts' write_slots and a memory that only reads and writes whole buffers."""
    from edgekv.runtime.memory import HeadMajorMemory, HostMemory

    b = load_bundle(tiny_bundle_float)  # (a head-major cache holds K and V only: no scale tensors)
    rng = np.random.default_rng(3)
    cells = [20, 3, 4, 11]  # out of order, a run of two
    for memory in (HostMemory(), HeadMajorMemory(spare=2), OpaqueMemory()):
        cache = KVCache(b, 24, memory=memory)
        snap = {n: rng.integers(1, 100, cache.slots_shape(n, len(cells))).astype(cache.dtypes[n]) for n in cache.cell_names}
        cache.write_cells(cells, snap)
        got = cache.read(24)
        for n in cache.cell_names:
            want = np.zeros_like(got[n])
            want[cells] = snap[n]
            np.testing.assert_array_equal(got[n], want, err_msg=f"{type(memory).__name__} {n}")


@pytest.mark.parametrize("env, want", [("3", 3), ("1", 1), ("0", None), ("two", None), ("", None)])
def test_default_threads_follow_omp_num_threads(env, want, monkeypatch):
    """Where --threads is not given: OMP_NUM_THREADS when it is a positive number, else every CPU
    this process may run on (its affinity); onnxruntime's session takes the same count."""
    import os

    import onnxruntime as ort

    from edgekv.runtime.backends.base import default_threads
    from edgekv.runtime.backends.ort import session_options

    monkeypatch.setenv("OMP_NUM_THREADS", env)
    expected = want if want is not None else len(os.sched_getaffinity(0))
    assert default_threads() == expected
    assert session_options(ort, None, 4).intra_op_num_threads == expected
    assert session_options(ort, 2, 4).intra_op_num_threads == 2  # --threads wins
