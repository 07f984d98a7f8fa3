"""ort-cuda's fused graph (docs/fused.md, "ort-cuda"), run here as far as a CPU allows: the
OrtCudaBackend class itself, its device a parameter ("cpu"), on the CPU provider's float16
GroupQueryAttention kernel (tests/test_fused_archs.py's stand-in for CUDA's), with its cache in
host OrtValues bound by address as on the GPU; both of its modes: the kernel taking
attention_bias (what the probe finds on the CPU, and onnxruntime 1.32's schema documents for
CUDA) and not taking it (older CUDA kernels; the probe's answer planted). What only a GPU shows
(each op placed on CUDA, the CUDA kernel's own numbers) is jetson/selftest.py's."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from edgekv.errors import BackendUnavailable, EdgeKVError  # noqa: E402
from edgekv.format.bundle import load_bundle  # noqa: E402
from edgekv.graph.passes.fused_match import BIAS  # noqa: E402
from edgekv.runtime.backends.fused import ATTENTION_ENV  # noqa: E402
from edgekv.runtime.backends.ort import OrtBackend  # noqa: E402
from edgekv.runtime.cache import KVCache  # noqa: E402
from tests.fake_gpu import cuda_on_cpu  # noqa: E402
from test_fused import CALLS, CAPACITY, needs_gqa, random_cells_call  # noqa: E402
from tests.stream_reference import new_sequence, run_stream

pytestmark = needs_gqa


CudaOnCpu = cuda_on_cpu()  # ort-cuda's code, the device a parameter: the CPU provider, host OrtValues


class CudaWithoutBias(CudaOnCpu):
    """... where the kernel refuses attention_bias (onnxruntime-gpu before 1.32's contract)."""

    def takes_bias(self):
        return False, "planted: the probe's refusal"


@pytest.fixture(scope="module")
def fp16(arch_bundles):
    """(kv, dtype) -> tiny SmolLM3 (a NoPE layer beside RoPE ones) exported so (conftest: once per run)."""
    return lambda kv, dtype="float16": arch_bundles("smollm3", kv, 128, dtype=dtype)


class Stream:
    def __init__(self, backend, bundle):
        self.backend, self.cache = backend, KVCache(bundle, CAPACITY, memory=backend.memory)
        self.seq = new_sequence(self.cache)

    def run(self, ids, rows):
        logits = run_stream(self.backend, self.cache, self.seq, ids, rows).copy()
        self.seq.advance(ids[0])
        return logits


def bound_addresses(backend) -> set[int]:
    """The addresses onnxruntime's binding writes the graph's outputs to."""
    return {o.data_ptr() for o in backend.binding.io.get_outputs()}


@pytest.mark.parametrize("cls", [CudaOnCpu, CudaWithoutBias])
def test_fused_on_the_cuda_path_equals_the_plain_graph(fp16, cls):
    """A float16 float-KV bundle: the fused graph on ort-cuda's path (no attention_bias, the cache
    in OrtValues bound whole) gives the plain float16 graph's logits to within that graph's own
    float16 noise (its distance from the float32 bundle, test_fused_archs' tolerance), the same
    top tokens where the plain graphs agree, and the cache in the same OrtValue buffers at the same
    addresses on every call: what onnxruntime writes is the cache, no host copy in between.
    Without attention_bias the session has no bias input and no op reads one."""
    b = load_bundle(fp16("float"))
    be = cls(b, threads=1, max_logits_rows=32, attention="fused")
    assert be.fused is not None and be.attention.startswith("attention: fused")
    biased = [n.input[10] for n in be.fused.model.graph.node if n.op_type == "GroupQueryAttention"
              and len(n.input) > 10 and n.input[10]]
    if cls is CudaWithoutBias:
        assert "without attention_bias" in be.attention and be.single_stream
        assert BIAS not in {i.name for i in be.session.get_inputs()} and not biased
    else:
        assert BIAS in {i.name for i in be.session.get_inputs()} and len(biased) == b.model["n_layers"]
    fused = Stream(be, b)
    assert fused.cache.layout == "heads"
    addresses = {name: buf.data_ptr() for name, buf in fused.cache.buffers.items()}
    assert all(isinstance(buf, ort.OrtValue) for buf in fused.cache.buffers.values())
    plain16 = Stream(OrtBackend(b, threads=1, max_logits_rows=32, attention="plain"), b)
    b32 = load_bundle(fp16("float", "float32"))
    plain32 = Stream(OrtBackend(b32, threads=1, max_logits_rows=32, attention="plain"), b32)
    rng = np.random.default_rng(3)
    got, want, ref = [], [], []
    for s in CALLS:
        ids = rng.integers(0, b.model["vocab_size"], (1, s))
        rows = np.arange(s)[None]
        got.append(fused.run(ids, rows)[0])
        want.append(plain16.run(ids, rows)[0])
        ref.append(plain32.run(ids, rows)[0])
        assert {n: buf.data_ptr() for n, buf in fused.cache.buffers.items()} == addresses
        assert set(addresses.values()) <= bound_addresses(be)  # present.* bound at the cache itself
    got, want, ref = map(np.concatenate, (got, want, ref))
    noise = np.abs(want - ref).max()
    assert 0 < np.abs(got - want).max() <= noise
    agree = want.argmax(-1) == ref.argmax(-1)
    assert np.array_equal(got.argmax(-1)[agree], want.argmax(-1)[agree])
    # the K/V the op wrote are in the OrtValues (read back through them), the plain cache's to float16 noise
    n = fused.seq.n
    for name, v in plain16.cache.read(n).items():
        np.testing.assert_allclose(fused.cache.read(n)[name].astype(np.float32), v.astype(np.float32),
                                   atol=0.05 * max(1.0, float(np.abs(v).max())), rtol=0)


def test_fused_int8_static_on_the_cuda_path(fp16):
    """A float16 int8-static bundle: one GroupQueryAttention per layer with the int8 cache in
    OrtValues; layer 0's codes within one step of the plain graph's (test_fused_archs: float16
    division against the op's float32) and the same greedy tokens on most prompts."""
    b = load_bundle(fp16("int8-static"))
    be = CudaOnCpu(b, threads=1, attention="fused")
    plain = OrtBackend(b, threads=1, attention="plain")
    assert [n.op_type for n in be.fused.model.graph.node].count("GroupQueryAttention") == b.model["n_layers"]
    same = 0
    for seed in range(6):
        streams = Stream(be, b), Stream(plain, b)
        assert streams[0].cache.buffers["past.0.key"].data_type() == "tensor(int8)"
        ids = np.random.default_rng(seed).integers(0, b.model["vocab_size"], (1, 6))
        tokens = [[], []]
        for st, out in zip(streams, tokens):
            logits = st.run(ids, np.array([[5]]))
            for _ in range(4):
                out.append(int(logits[0, -1].argmax()))
                logits = st.run(np.array([[out[-1]]]), np.array([[0]]))
        a, f = streams[1].cache.read(6), streams[0].cache.read(6)
        for kv in ("key", "value"):
            d = a[f"past.0.{kv}"].astype(np.int16) - f[f"past.0.{kv}"].astype(np.int16)
            assert np.abs(d).max() <= 1, f"seed {seed}: layer 0 {kv} codes more than one step apart"
        same += tokens[0] == tokens[1]
    assert same >= 4, f"greedy tokens equal on {same} of 6 prompts"


def test_float32_graph_keeps_the_plain_path_on_cuda(fp16, monkeypatch):
    """CUDA's GroupQueryAttention is float16/bfloat16 only: a float32 bundle runs the graph as
    written on ort-cuda under auto, its load line saying why, and EDGEKV_ATTENTION=fused there is
    one line. auto on a float16 static bundle fuses where the kernel takes attention_bias, and
    keeps the graph as written where it does not (the fused graph could not serve chat's and
    serve's masked calls), saying why and how to ask for it."""
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    b32 = load_bundle(fp16("int8-static", "float32"))
    be = CudaOnCpu(b32, threads=1)
    assert be.fused is None and "float32" in be.attention and "float16" in be.attention, be.attention
    assert "key_mask" in {i.name for i in be.session.get_inputs()}
    with pytest.raises(BackendUnavailable, match="float16 and bfloat16 graphs"):
        CudaOnCpu(b32, threads=1, attention="fused")
    assert CudaOnCpu(load_bundle(fp16("int8-static")), threads=1).fused is not None  # auto fuses, as on CPU
    auto = CudaWithoutBias(load_bundle(fp16("int8-static")), threads=1)
    assert auto.fused is None and f"{ATTENTION_ENV}=fused" in auto.attention and "planted" in auto.attention
    monkeypatch.setenv(ATTENTION_ENV, "fused")
    assert CudaWithoutBias(load_bundle(fp16("int8-static")), threads=1).fused is not None


def test_calls_the_op_cannot_mask_are_one_line_on_cuda(fp16):
    """Without attention_bias the op's own rule is the only mask: an engine call appended at the
    past's end with every cell seen runs (and equals the stream's), a call written inside the
    past, one hiding a past cell, or one whose positions are not its slots is one line naming
    EDGEKV_ATTENTION=plain, never a wrong attention. Serve's fused slots are refused in one line."""
    b = load_bundle(fp16("float"))
    be = CudaWithoutBias(b, threads=1, max_logits_rows=8, attention="fused")
    st = Stream(be, b)
    ids = np.random.default_rng(5).integers(0, b.model["vocab_size"], (1, 8))
    want = st.run(ids, np.array([[7]]))
    cache = KVCache(b, CAPACITY, memory=be.memory)
    mask = np.ones((1, 5, 5), np.bool_) & np.tri(5, dtype=np.bool_)[None]
    be.run_cells(cache, 0, 0, ids[:, :5], np.arange(5)[None], mask, np.array([[4]]))
    mask = np.ones((1, 3, 8), np.bool_)
    mask[0, :, 5:] = np.tri(3, dtype=np.bool_)
    got = be.run_cells(cache, 5, 5, ids[:, 5:], np.arange(5, 8)[None], mask, np.array([[2]]))
    np.testing.assert_array_equal(got, want)
    hidden = mask.copy()
    hidden[0, :, 1] = False
    for past, write, pos, m in ((5, 2, np.arange(5, 8), mask), (5, 5, np.arange(5, 8), hidden),
                                (5, 5, np.arange(9, 12), mask)):
        with pytest.raises(EdgeKVError, match=f"{ATTENTION_ENV}=plain"):
            be.run_cells(cache, past, write, ids[:, 5:], pos[None], m, np.array([[2]]))
    with pytest.raises(BackendUnavailable, match="fused slots"):
        be.slot_memory(2)


def test_engine_calls_and_moved_calls_on_the_device_buffer(fp16, monkeypatch):
    """Where the kernel takes attention_bias, the engine's calls (any mask, any positions, the
    write run at, inside and beyond the past) run as on the CPU's fused path: the same logits
    and the same cells, bit for bit, as OrtBackend's fused graph over host memory, with every
    moved call's new K/V copied by the device buffer's own copy_slots (one per buffer and call)."""
    from edgekv.runtime.backends.gpu import OrtValueHeadMajorMemory

    b = load_bundle(fp16("float"))
    dev = CudaOnCpu(b, threads=1, max_logits_rows=8, attention="fused")
    host = OrtBackend(b, threads=1, max_logits_rows=8, attention="fused")
    assert isinstance(dev.memory, OrtValueHeadMajorMemory) and dev.memory.spare == host.memory.spare > 0
    copies = []
    real = OrtValueHeadMajorMemory.copy_slots
    monkeypatch.setattr(OrtValueHeadMajorMemory, "copy_slots",
                        lambda self, buf, src, dst, n: (copies.append((src, dst, n)), real(self, buf, src, dst, n)))
    caches = [KVCache(b, CAPACITY, memory=be.memory) for be in (dev, host)]
    rng = np.random.default_rng(5)
    seed = {n: rng.standard_normal(caches[1].slots_shape(n, CAPACITY)).astype(np.float16) for n in caches[1].names}
    for c in caches:
        c.write(seed)
    cases = [(0, 4, 0), (0, 1, 7), (20, 3, 20), (20, 3, 5), (20, 3, 40), (CAPACITY - 2, 2, 3),
             (CAPACITY, 5, CAPACITY - 9), (CAPACITY - 1, 1, CAPACITY - 1)]
    moved = 0
    for past, s, write in cases:
        ids, pos, mask = random_cells_call(rng, b, CAPACITY, past, s, write)
        rows = np.arange(s)[None]
        got = dev.run_cells(caches[0], past, write, ids, pos, mask, rows).copy()
        want = host.run_cells(caches[1], past, write, ids, pos, mask, rows).copy()
        np.testing.assert_array_equal(got, want, err_msg=f"{(past, s, write)}")
        a, f = caches[1].read(CAPACITY), caches[0].read(CAPACITY)
        for n in a:
            np.testing.assert_array_equal(f[n], a[n], err_msg=f"{n} after {(past, s, write)}")
        moved += not (write == past and (past > 0 or np.all(np.diff(pos[0]) == 1)))  # _run_fused's direct
    assert moved >= 4 and all(src == CAPACITY for src, _, _ in copies)
    assert len(copies) == len(caches[0].names) * moved


def test_serve_slots_on_the_device_buffer(fp16):
    """Where the kernel takes the bias (and query_seqlens: onnxruntime >= 1.32), serve's fused
    slots run on ort-cuda's path with the cache in OrtValues [K, Hkv, L, D], each call binding its
    slots by address: the same tokens and logits, bit for bit, as ort-cpu's fused slots over host
    memory, for requests joining, a prompt prefilled in chunks beside decodes, and a slot reused
    (tests/serving.py's staggered schedule)."""
    from edgekv.runtime.backends.gpu import OrtValueSlotMemory
    from edgekv.runtime.batching import Batcher
    from tests.serving import staggered

    b = load_bundle(fp16("int8-static"))
    rng = np.random.default_rng(2)
    spec = {k: ([int(t) for t in rng.integers(3, b.model["vocab_size"], n)], m)
            for k, n, m in (("A", 7, 12), ("B", 10, 3), ("C", 25, 6), ("D", 9, 8))}
    runs = []
    for be in (CudaOnCpu(b, threads=1, attention="fused"), OrtBackend(b, threads=1, attention="fused")):
        cache = KVCache(b, 120, memory=be.slot_memory(3))
        runs.append(staggered(Batcher(be, cache, parallel=3, prefill_chunk=8), spec, prefill_steps=3))
        if not runs[1:]:
            assert isinstance(cache.memory, OrtValueSlotMemory)
            assert all(isinstance(buf, ort.OrtValue) and buf.shape() == [3, b.model["n_kv_heads"], 40, b.model["head_dim"]]
                       for buf in cache.buffers.values())
    dev, host = runs
    assert dev.mixed and dev.first_cells["D"] == dev.first_cells["B"]
    for k in spec:
        assert dev.reqs[k].out == host.reqs[k].out and len(dev.reqs[k].out) == spec[k][1], k
        assert all(np.array_equal(x, y) for x, y in zip(dev.reqs[k].logits, host.reqs[k].logits)), k


def test_copy_slots_through_cuda_python(monkeypatch):
    """The device copy's strided arithmetic: one cudaMemcpy2D per buffer (tests/fake_gpu.py's
    runtime, host addresses as device ones) moves slots [src, src + n) to [dst, dst + n) in every
    head and nothing else; overlapping or out-of-range slots are refused."""
    from tests import fake_gpu

    from edgekv.runtime.backends.gpu import OrtValueHeadMajorMemory

    _, rt = fake_gpu.install(monkeypatch)
    mem = OrtValueHeadMajorMemory(ort, "cpu", spare=4)
    buf = mem.alloc((8, 1, 3, 5), np.int8)  # [1, 3, 12, 5]
    vals = np.random.default_rng(1).integers(-100, 100, (1, 3, 12, 5)).astype(np.int8)
    buf.update_inplace(vals)
    mem.device = "cuda"  # the copy goes the device's way: cuda-python's runtime
    mem.copy_slots(buf, 8, 2, 3)
    want = vals.copy()
    want[0, :, 2:5] = vals[0, :, 8:11]
    np.testing.assert_array_equal(buf.numpy(), want)
    assert rt.copies2d == 1
    for src, dst, n in ((8, 6, 3), (10, 0, 3), (0, 11, 2)):
        with pytest.raises(EdgeKVError):
            mem.copy_slots(buf, src, dst, n)


def test_selftest_reads_where_each_gqa_node_ran(fp16, tmp_path):
    """jetson/selftest.py's fused check, run here on the CPU stand-in: every GroupQueryAttention
    node's provider read from onnxruntime's profile (all of them, one per layer) and the fused
    greedy tokens against the graph as written; asked for CUDA, the CPU's nodes fail the check,
    each named (a node onnxruntime quietly placed on the CPU is what it is there to catch)."""
    from jetson.selftest import fused_check

    b = load_bundle(fp16("int8-static"))
    res, ok = fused_check(b, 128, tmp_path, steps=8, backend_cls=CudaOnCpu, provider="CPUExecutionProvider")
    assert ok and res["status"] == "pass" and res["gqa_nodes"] == b.model["n_layers"], res
    assert res["greedy_steps"] == 8 and list(tmp_path.glob("edgekv-fused-profile*.json"))
    res, ok = fused_check(b, 128, tmp_path, steps=2, backend_cls=CudaOnCpu)
    assert not ok and res["status"] == "fail"
    assert len(res["gqa_not_on_CUDAExecutionProvider"]) == b.model["n_layers"]
    res, ok = fused_check(load_bundle(fp16("int8-static", "float32")), 128, tmp_path, backend_cls=CudaOnCpu)
    assert ok and res["status"] == "skipped"


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="needs onnxruntime-gpu with CUDA; jetson/selftest.sh runs it on the device")
def test_the_fused_graph_on_real_cuda(fp16, tmp_path):
    """Where a GPU and onnxruntime-gpu exist: the self-test's fused check on the real provider
    (every GroupQueryAttention on CUDA, greedy tokens against the graph as written)."""
    from jetson.selftest import fused_check

    res, ok = fused_check(load_bundle(fp16("int8-static")), 128, tmp_path, steps=8)
    assert ok and res["status"] == "pass", res
