"""Issue 41, two faults that must end in one clear line: a bundle copied with hard links (`cp -al`,
`rsync --link-dest`) loads, and a KV cache that will not fit is refused before anything is
allocated, naming the bytes it needs and those available (MemAvailable, a cgroup's limit, RLIMIT_AS)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from edgekv.errors import EdgeKVError
from edgekv.format.bundle import load_bundle
from edgekv.runtime import memory
from edgekv.runtime.cache import KVCache
from edgekv.runtime.memory import HostMemory
from tests.conftest import cli
from tests.stream_reference import reference

PROMPT = [1, 17, 42, 99, 3, 250, 7, 12, 300, 5, 64, 8]


def _copy(src, dst):
    """A private copy of a shared fixture: linking the fixture's own files would give every other
    test's bundle a second link too."""
    shutil.copytree(src, dst)
    return dst


def _weights_in_data_file(bundle, threshold=256):
    """The bundle saved again with every initializer of more than `threshold` bytes in
    model.onnx.data, as a full-size model has them (the tiny models' block scales are under the
    exporter's 1 KiB and stay inside model.onnx, where our load-time rewrites read them without
    opening model.onnx.data); the manifest's sizes and hashes follow."""
    import onnx

    from edgekv.format.bundle import MANIFEST, file_sha256

    model = onnx.load(str(bundle / "model.onnx"))
    (bundle / "model.onnx.data").unlink()  # onnx appends to a data file that is there
    onnx.save(model, str(bundle / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=threshold)
    m = json.loads((bundle / MANIFEST).read_text())
    for name in ("model.onnx", "model.onnx.data"):
        m["files"]["sizes"][name] = (bundle / name).stat().st_size
        m["files"]["sha256"][name] = file_sha256(bundle / name)
    (bundle / MANIFEST).write_text(json.dumps(m))
    return bundle


def _hard_linked(src, dst):
    """`cp -al src dst`: every file a second name of the same inode."""
    dst.mkdir()
    for f in src.iterdir():
        os.link(f, dst / f.name)
    return dst


def _state(folder):
    """Every file's bytes, link count and times: what a loader that only reads leaves as it was."""
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_nlink, p.stat().st_mtime_ns,
                     p.stat().st_ino) for p in sorted(folder.iterdir())}


def _logits(path):
    from edgekv.runtime.assemble import open_runtime

    with open_runtime(path, 64, "ort-cpu", threads=1, log=None) as rt:
        gen = reference(rt)
        rows = [gen.prefill(PROMPT).copy()]
        for _ in range(4):
            rows.append(gen.decode_step(int(np.argmax(rows[-1]))).copy())
    return np.stack(rows)


# -- (a) a hard-linked bundle ---------------------------------------------------------------------

@pytest.mark.parametrize("which", ["tiny_bundle_int8", "tiny_bundle_int8_wint4", "tiny_bundle_int8_static"])
def test_hard_linked_bundle_loads_with_the_same_logits(which, request, tmp_path):
    """Float weights (tiny_bundle_int8) go to onnxruntime as they are (it reads hard-linked files);
    block-quantized ones (the quickstart's GGUF kind) have their scales read by our load-time
    rewrites through onnx, which refused a file with other hard links as a "potential hardlink
    attack" (a "corrupt bundle"); a static int8 cache's fused graph (tiny_bundle_int8_static) is
    built from weights read so too. The logits of the original and of its hard-linked copy agree bit for bit."""
    original = _weights_in_data_file(_copy(request.getfixturevalue(which), tmp_path / "original"))
    linked = _hard_linked(original, tmp_path / "linked")
    assert (linked / "model.onnx.data").stat().st_nlink == 2
    before = _state(linked)
    want = _logits(original)
    got = _logits(linked)
    assert np.array_equal(want, got)  # bit for bit: the same weights, read from the same inode
    assert _state(linked) == before  # the loader only reads: nothing written, replaced or added


def test_hard_linked_bundle_generates_from_the_command_line(tiny_bundle_int8_wint4, tmp_path):
    linked = _hard_linked(_weights_in_data_file(_copy(tiny_bundle_int8_wint4, tmp_path / "original")),
                          tmp_path / "linked")
    r = cli("generate", linked, "hi", "--max-new-tokens", "3", "--backend", "ort-cpu", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "hard link" not in r.stderr and "corrupt" not in r.stderr


@pytest.mark.parametrize("which", ["tiny_bundle_int8_wint4", "tiny_bundle_int8_static"])
def test_hard_links_refused_in_one_line_where_onnx_will_not_read_them(which, request, tmp_path, monkeypatch):
    """An onnx whose reading we cannot reach: its own refusal stands, said as what to do (copy
    without links), never "corrupt"."""
    import onnx.external_data_helper as edh
    import onnx.onnx_cpp2py_export.checker as c_checker

    import edgekv.format.bundle as fb

    monkeypatch.setattr(fb, "allow_hardlinked_weights", lambda: False)
    monkeypatch.setattr(edh, "_open_external_data_fd", lambda b, loc, name, ro: c_checker._open_external_data(b, loc, name, ro))
    linked = _hard_linked(_weights_in_data_file(_copy(request.getfixturevalue(which), tmp_path / "original")),
                          tmp_path / "linked")
    r = cli("generate", linked, "hi", "--max-new-tokens", "2", "--backend", "ort-cpu", "--threads", "1")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "corrupt" not in lines[0] and "cp -r" in lines[0] and "hard links" in lines[0]


def test_only_a_hard_link_is_let_through(tiny_bundle_int8_wint4, tmp_path):
    """What onnx refuses beside hard links stands: the weights file as a symbolic link (to a file
    inside the bundle, which the manifest's checks let through) is refused in one line, its
    target untouched."""
    b = _weights_in_data_file(_copy(tiny_bundle_int8_wint4, tmp_path / "b"))
    (b / "model.onnx.data").rename(b / "weights.bin")
    (b / "model.onnx.data").symlink_to("weights.bin")
    target = _state(b)["weights.bin"]
    r = cli("generate", b, "hi", "--max-new-tokens", "2", "--backend", "ort-cpu", "--threads", "1")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "symbolic link" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert _state(b)["weights.bin"] == target and (b / "model.onnx.data").is_symlink()


# -- (b) a KV cache larger than the memory this process may take -----------------------------------

class CountingMemory(HostMemory):
    """Host memory (its free bytes the real limits') that counts allocations."""

    def __init__(self):
        self.allocs = 0

    def alloc(self, shape, dtype):
        self.allocs += 1
        return super().alloc(shape, dtype)


def _fake_proc(tmp_path, monkeypatch, avail_kib=64 << 20, cgroup="0::/", vm_kib=None):
    """/proc/meminfo, /proc/self/cgroup and /proc/self/status as files of the test's."""
    (tmp_path / "meminfo").write_text(f"MemTotal:       {avail_kib * 2} kB\nMemAvailable:   {avail_kib} kB\n")
    (tmp_path / "cgroup").write_text(cgroup + "\n")
    (tmp_path / "status").write_text(f"Name:\tpython\nVmSize:\t{vm_kib or 0} kB\nVmData:\t{vm_kib or 0} kB\n")
    root = tmp_path / "sys-fs-cgroup"
    root.mkdir()
    monkeypatch.setattr(memory, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(memory, "PROC_CGROUP", str(tmp_path / "cgroup"))
    monkeypatch.setattr(memory, "PROC_STATUS", str(tmp_path / "status"))
    monkeypatch.setattr(memory, "CGROUP_ROOT", str(root))
    return root


def _refused(bundle, ctx):
    mem = CountingMemory()
    need = load_bundle(bundle).kv_bytes_per_token() * ctx
    with pytest.raises(EdgeKVError) as e:
        KVCache(load_bundle(bundle), ctx, memory=mem)
    assert mem.allocs == 0  # refused before anything was allocated
    msg = e.value.explain()
    assert f"({need} bytes)" in msg and "\n" not in msg
    return msg


def test_mem_available_is_the_limit_without_others(tiny_bundle_int8, tmp_path, monkeypatch):
    _fake_proc(tmp_path, monkeypatch, avail_kib=16)  # 16 KiB available; 256 slots need 36 KiB
    msg = _refused(tiny_bundle_int8, 256)
    assert "(16384 bytes: MemAvailable 16.0 KiB" in msg


def test_a_cgroup_v2_limit_below_mem_available_refuses(tiny_bundle_int8, tmp_path, monkeypatch):
    root = _fake_proc(tmp_path, monkeypatch, cgroup="0::/user.slice/edgekv")
    own = root / "user.slice" / "edgekv"
    own.mkdir(parents=True)
    (own / "memory.max").write_text(f"{1 << 20}\n")  # 1 MiB, 1 MiB - 30000 bytes of it in use, 4096 reclaimable
    (own / "memory.current").write_text(f"{(1 << 20) - 30000}\n")
    (own / "memory.stat").write_text("anon 1000\nfile 8192\ninactive_file 4096\n")
    (root / "user.slice" / "memory.max").write_text("max\n")
    assert memory.available_memory() == 34096
    msg = _refused(tiny_bundle_int8, 256)
    assert "(34096 bytes: the cgroup's memory.max 1.0 MiB" in msg and "MemAvailable 64.0 GiB" in msg
    KVCache(load_bundle(tiny_bundle_int8), 200, memory=CountingMemory())  # 28800 bytes fit


def test_a_cgroup_v1_parent_limit_counts(tiny_bundle_int8, tmp_path, monkeypatch):
    root = _fake_proc(tmp_path, monkeypatch, cgroup="4:memory:/docker/abc")
    for folder, limit, usage in (("docker/abc", 1 << 62, 5000), ("docker", 40000, 20000), ("", 1 << 62, 1 << 30)):
        d = root / "memory" / folder
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (d / "memory.stat").write_text("cache 0\ntotal_inactive_file 0\n")
    assert memory.available_memory() == 20000
    assert "memory.limit_in_bytes" in _refused(tiny_bundle_int8, 256)


def test_rlimit_as_counts_what_is_already_mapped(tiny_bundle_int8, tmp_path, monkeypatch):
    import resource

    _fake_proc(tmp_path, monkeypatch, vm_kib=1000)
    real = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit",
                        lambda r: (1000 * 1024 + 20000, -1) if r == resource.RLIMIT_AS else real(r))
    assert memory.available_memory() == 20000
    assert "(20000 bytes: RLIMIT_AS" in _refused(tiny_bundle_int8, 256)


def test_a_failed_allocation_is_one_line_too(tiny_bundle_int8):
    """A limit the check cannot see (memory taken since it looked): the MemoryError as the same line."""
    class Failing(CountingMemory):
        def alloc(self, shape, dtype):
            super().alloc(shape, dtype)
            if self.allocs == 3:
                raise MemoryError("Unable to allocate")
            return HostMemory.alloc(self, shape, dtype)

    with pytest.raises(EdgeKVError, match=r"needs .* MiB \(36864 bytes\), only .* MiB free on cpu"):
        KVCache(load_bundle(tiny_bundle_int8), 256, memory=Failing())


VMPEAK = """
import sys
from edgekv.runtime.assemble import open_runtime
with open_runtime(sys.argv[1], 64, "ort-cpu", threads=1, log=None) as rt:
    rt.stream().prefill([1, 2, 3])
    print([l for l in open("/proc/self/status") if l.startswith("VmPeak")][0].split()[1])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status: Linux")
def test_generate_under_rlimit_as_refuses_a_large_context_in_one_line(bundle_copy):
    """The issue's run: a bundle verified for 4M tokens, `generate --ctx` that many under a limit
    on the address space (the tiny model's 576 MiB of cache, 256 MiB left once loaded): one line
    with both byte counts, exit 1, no traceback."""
    import resource

    ctx = 1 << 22
    m = json.loads((bundle_copy / "edgekv.json").read_text())
    m["max_context"] = ctx
    (bundle_copy / "edgekv.json").write_text(json.dumps(m))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    peak = subprocess.run([sys.executable, "-c", VMPEAK, str(bundle_copy)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert peak.returncode == 0, peak.stderr
    limit = int(peak.stdout) * 1024 + (256 << 20)  # what loading it maps, and 256 MiB more

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    r = subprocess.run([sys.executable, "-m", "edgekv", "generate", str(bundle_copy), "hi", "--ctx", str(ctx),
                        "--max-new-tokens", "2", "--backend", "ort-cpu", "--threads", "1"],
                       capture_output=True, text=True, env=env, preexec_fn=cap, timeout=300)
    lines = r.stderr.strip().splitlines()
    need = load_bundle(bundle_copy).kv_bytes_per_token() * ctx
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert f"needs 576.0 MiB ({need} bytes), only" in lines[0] and "RLIMIT_AS" in lines[0] and "--ctx" in lines[0]


def test_host_buffers_are_zeroed_mappings_of_their_own():
    """HostMemory's buffers: zero-filled, writable, C-contiguous, page-aligned (a mapping each,
    handed back to the system when freed), and a mapping refused is the MemoryError the cache's
    one-line refusal reports."""
    import mmap

    buf = HostMemory().alloc((3, 1, 2, 64), np.int8)
    assert buf.shape == (3, 1, 2, 64) and not buf.any()
    assert buf.flags.writeable and buf.flags.c_contiguous and buf.ctypes.data % mmap.PAGESIZE == 0
    buf[1] = 7
    assert int(buf.sum()) == 7 * 128
    # private mappings, as malloc's: RLIMIT_DATA (which memory_limits reads) counts them too
    for limit in ("RLIMIT_AS", "RLIMIT_DATA"):
        script = ("import resource, numpy as np\n"
                  "from edgekv.runtime.memory import HostMemory\n"
                  f"resource.setrlimit(resource.{limit}, (2 << 30, 2 << 30))\n"
                  "try:\n    HostMemory().alloc((4 << 30,), np.int8)\n"
                  "except MemoryError as e:\n    print('MemoryError', e)\n")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert out.stdout.startswith("MemoryError Unable to allocate 4294967296 bytes"), limit + out.stdout + out.stderr
