"""Where KV buffers live: the `KVMemory` protocol every backend's memory follows, and host memory.

The cache and the backends use a memory's four operations (alloc, ptr, read, write), so the
pointer arithmetic the GPU backends rely on is the same code the CPU tests run; memories that
can do better also copy row ranges (`RowMemory`: a chat turn's undo, /save, /load) and move rows
(`MovesRows`: the serving pool's compaction). Device memories
(onnxruntime OrtValues, cuda-python) are in edgekv/runtime/backends/gpu.py."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable  # isinstance() checks that every member is there (tests)
class KVMemory(Protocol):
    """Memory a KV cache is allocated from: every buffer once, zero-filled, addressed by pointer."""
    device: str  # "cpu" or "cuda": a backend binds only buffers on its own device
    slots: int  # the equal sequence slots the cells are split into (1: one sequence may span them all)

    def free_bytes(self) -> int | None:
        """Bytes that can still be allocated, or None where unknown."""

    def alloc(self, shape: tuple, dtype) -> Any:
        """A zero-filled buffer (its type is the memory's own)."""

    def ptr(self, buf: Any) -> int:
        """The buffer's address."""

    def read(self, buf: Any, n: int) -> np.ndarray:
        """A host copy of the buffer's first n rows."""

    def write(self, buf: Any, arr: np.ndarray) -> None:
        """Copy `arr` into the buffer's first len(arr) rows."""


@runtime_checkable
class RowMemory(KVMemory, Protocol):
    """Memory that also copies slot ranges, so a chat turn's undo copies only the slots it overwrites."""

    def read_rows(self, buf: Any, start: int, stop: int) -> np.ndarray:
        """A host copy of rows [start, stop)."""

    def write_rows(self, buf: Any, start: int, arr: np.ndarray) -> None:
        """Copy `arr` into rows [start, start + len(arr))."""

    def write_slots(self, buf: Any, slots: np.ndarray, arr: np.ndarray) -> None:
        """Copy arr[i] into row slots[i], the slots distinct (a ring's scattered writes); device
        memories by write_slots_by_runs."""


@runtime_checkable
class MovesRows(KVMemory, Protocol):
    """Memory that moves rows itself (the serving pool's compaction), without a whole-buffer copy."""

    def move_rows(self, buf: Any, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy row src[i] to row dst[i], every source read before any row is written."""


def runs(cells: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive slots in `cells`, in order."""
    if cells.size == 0:
        return []
    cut = np.flatnonzero(np.diff(cells) != 1) + 1
    starts = np.r_[cells[0], cells[cut]]
    stops = np.r_[cells[cut - 1] + 1, cells[-1] + 1]
    return list(zip(starts.tolist(), stops.tolist()))


def write_slots_by_runs(memory: RowMemory, buf: Any, slots: np.ndarray, arr: np.ndarray) -> None:
    """RowMemory.write_slots as one write_rows per run of consecutive slots: for memories without
    a scatter of their own (device memories: a copy per run)."""
    i = 0
    for a, b in runs(slots):
        memory.write_rows(buf, a, arr[i: i + b - a])
        i += b - a


# where the limits on this process's memory are read (tests point them at files of their own)
MEMINFO = "/proc/meminfo"
PROC_STATUS = "/proc/self/status"
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
NO_CGROUP_LIMIT = 1 << 60  # cgroup v1 says "no limit" as 2^63 rounded down to a page


def _text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, ValueError):
        return None


def kib_field(path: str, key: str) -> int | None:
    """`key:  N kB` of a /proc file, in bytes."""
    for line in (_text(path) or "").splitlines():
        if line.startswith(key + ":"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def _int_file(path: str) -> int | None:
    t = _text(path)
    try:
        return int(t.strip()) if t is not None else None
    except ValueError:  # cgroup v2's "max": no limit
        return None


def _stat_field(path: str, key: str) -> int:
    for line in (_text(path) or "").splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            try:
                return int(v)
            except ValueError:
                return 0
    return 0


def _cgroup_dirs() -> list[tuple[str, str, str, str, str]]:
    """(folder, limit file, usage file, memory.stat's inactive-file key, limit name) of this
    process's memory cgroup and its ancestors up to the mount (v2, then v1); a namespaced
    cgroup (/proc/self/cgroup says "/") is the mount itself."""
    out = []
    for line in (_text(PROC_CGROUP) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":  # v2's unified hierarchy
            mount, files = CGROUP_ROOT, ("memory.max", "memory.current", "inactive_file", "memory.max")
        elif "memory" in parts[1].split(","):  # v1's memory controller
            mount, files = os.path.join(CGROUP_ROOT, "memory"), \
                ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file", "memory.limit_in_bytes")
        else:
            continue
        rel = parts[2].strip().strip("/")
        if ".." in rel.split("/"):
            continue
        folder = os.path.join(mount, rel) if rel else mount
        while True:
            out.append((folder, *files))
            if os.path.normpath(folder) == os.path.normpath(mount):
                break
            folder = os.path.dirname(folder)
    if not out:  # no /proc/self/cgroup: the mount's own files, where there are any
        out = [(CGROUP_ROOT, "memory.max", "memory.current", "inactive_file", "memory.max"),
               (os.path.join(CGROUP_ROOT, "memory"), "memory.limit_in_bytes", "memory.usage_in_bytes",
                "total_inactive_file", "memory.limit_in_bytes")]
    return out


def _gib(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def memory_limits() -> list[tuple[int, str]]:
    """Each limit on the memory this process can still take, as (bytes left, what it is): the
    kernel's MemAvailable, a memory cgroup's limit less its usage (its inactive page cache counted
    as free: the kernel reclaims that first), and RLIMIT_AS / RLIMIT_DATA less the address space /
    data this process already maps. Those that are unknown or unlimited are left out."""
    limits = []
    avail = kib_field(MEMINFO, "MemAvailable")
    if avail is not None:
        limits.append((avail, f"MemAvailable {_gib(avail)}"))
    seen = set()
    for folder, limit_file, usage_file, inactive_key, name in _cgroup_dirs():
        limit = _int_file(os.path.join(folder, limit_file))
        if limit is None or limit >= NO_CGROUP_LIMIT or folder in seen:
            continue
        seen.add(folder)
        usage = _int_file(os.path.join(folder, usage_file)) or 0
        inactive = _stat_field(os.path.join(folder, "memory.stat"), inactive_key)
        left = max(0, min(limit, limit - usage + inactive))
        limits.append((left, f"the cgroup's {name} {_gib(limit)}, {_gib(usage - inactive)} of it in use"))
    try:
        import resource
    except ImportError:  # not on Windows
        return limits
    for rlimit, name, used in ((resource.RLIMIT_AS, "RLIMIT_AS", "VmSize"),
                               (resource.RLIMIT_DATA, "RLIMIT_DATA", "VmData")):
        soft = resource.getrlimit(rlimit)[0]
        if soft == resource.RLIM_INFINITY or soft < 0:
            continue
        mapped = kib_field(PROC_STATUS, used)
        if mapped is None:
            continue
        limits.append((max(0, soft - mapped), f"{name} {_gib(soft)}, {_gib(mapped)} of it mapped"))
    return limits


def available_memory() -> int | None:
    """Bytes this process can still allocate: the tightest of `memory_limits` (None where none is known)."""
    limits = memory_limits()
    return min(n for n, _ in limits) if limits else None


def describe_available() -> str:
    """What limits the memory this process can take, tightest first (for an error message)."""
    return "; ".join(what for _, what in sorted(memory_limits(), key=lambda x: x[0])) or "no limit known"


# private, as malloc's own large blocks: counted in RLIMIT_DATA (memory_limits), copied on fork,
# eligible for transparent huge pages; shared memory is none of these (POSIX only; elsewhere the default)
PRIVATE = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}


def mapped_zeros(shape: tuple, dtype) -> np.ndarray:
    """A zero-filled array in a memory mapping of its own: freed, it goes back to the system at
    once, where one from malloc's heap can stay in it (a 4,096-cell cache's buffers, 768 KiB each
    for the default model, are below the size glibc maps by itself once its threshold has grown),
    under the next cache's. Its pages are touched here, so the memory is really ours from the start."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    try:
        mapped = mmap.mmap(-1, max(n, 1), **PRIVATE)
    except OSError as e:  # ENOMEM: the cache's refusal reports a MemoryError in one line
        raise MemoryError(f"Unable to allocate {n} bytes: {e.strerror}") from None
    buf = np.frombuffer(mapped, np.uint8, count=n).view(dtype).reshape(shape)
    buf.fill(0)
    return buf


class HostMemory:
    """KV buffers in host RAM as numpy arrays."""
    device = "cpu"
    layout = "slots"  # slot i of a buffer is its i-th row (cache.ptr's arithmetic); HeadMajorMemory: "heads"
    slots = 1

    def free_bytes(self) -> int | None:
        return available_memory()

    def free_note(self) -> str:
        """What limits free_bytes (the KV cache's refusal says it; "" where a subclass counts its own)."""
        return describe_available() if type(self).free_bytes is HostMemory.free_bytes else ""

    def alloc(self, shape: tuple, dtype) -> np.ndarray:
        return mapped_zeros(shape, dtype)

    def ptr(self, buf: np.ndarray) -> int:
        return buf.ctypes.data

    def read(self, buf: np.ndarray, n: int) -> np.ndarray:
        return buf[:n].copy()

    def write(self, buf: np.ndarray, arr: np.ndarray) -> None:
        buf[: len(arr)] = arr

    # RowMemory: slot ranges
    def read_rows(self, buf: np.ndarray, start: int, stop: int) -> np.ndarray:
        return buf[start:stop].copy()

    def write_rows(self, buf: np.ndarray, start: int, arr: np.ndarray) -> None:
        buf[start: start + len(arr)] = arr

    def write_slots(self, buf: np.ndarray, slots: np.ndarray, arr: np.ndarray) -> None:
        """arr [n, 1, Hkv, D] to the given distinct slots at once (a ring's scattered writes)."""
        buf[slots] = arr

    # MovesRows: gathered, then scattered, in place
    def move_rows(self, buf: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        buf[dst] = buf[src]


class HeadMajorMemory(HostMemory):
    """KV buffers in host RAM head-major, [1, Hkv, slots + spare, D] (GroupQueryAttention's BNSH,
    the fused graph's cache: docs/fused.md), for a cache that asks for slot-major [slots, 1, Hkv, D].
    Every copy in or out speaks slots, as HostMemory's does ([n, 1, Hkv, D]), so snapshots, the
    prompt cache, /save files and the engine's cell moves are the same in either layout. The
    `spare` slots after the capacity are where the fused op writes a call whose cells lie inside
    the past (a ring's overwrite, a fragmented pool) before they are moved there (OrtBackend)."""
    layout = "heads"

    def __init__(self, spare: int = 0):
        self.spare = spare

    def alloc(self, shape: tuple, dtype) -> np.ndarray:
        if len(shape) != 4 or shape[1] != 1:
            raise ValueError(f"a head-major cache holds [slots, 1, Hkv, D] tensors, not {list(shape)}")
        slots, _, heads, dim = shape
        return super().alloc((1, heads, slots + self.spare, dim), dtype)

    @staticmethod
    def _slots(buf: np.ndarray, start: int, stop: int) -> np.ndarray:
        return buf[0, :, start:stop].transpose(1, 0, 2)[:, None]  # [n, 1, Hkv, D], a view

    def read(self, buf: np.ndarray, n: int) -> np.ndarray:
        return self._slots(buf, 0, n).copy()

    def write(self, buf: np.ndarray, arr: np.ndarray) -> None:
        self.write_rows(buf, 0, arr)

    def read_rows(self, buf: np.ndarray, start: int, stop: int) -> np.ndarray:
        return self._slots(buf, start, stop).copy()

    def write_rows(self, buf: np.ndarray, start: int, arr: np.ndarray) -> None:
        buf[0, :, start: start + len(arr)] = arr[:, 0].transpose(1, 0, 2)

    def write_slots(self, buf: np.ndarray, slots: np.ndarray, arr: np.ndarray) -> None:
        buf[0, :, slots] = arr[:, 0]  # (the gathered slots come first: [n, Hkv, D])

    def move_rows(self, buf: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        buf[0, :, dst] = buf[0, :, src]  # the fancy index gathers every source first


class SlotMemory(HostMemory):
    """KV buffers in host RAM as `slots` sequence slots, [slots, Hkv, C / slots, D] (serve's
    fused layout, llama-server's --parallel: docs/serve.md, "Fused slots"), for a cache that
    asks for [C, 1, Hkv, D]. Cell c is slot c // L's position c % L (L = C / slots), so a
    sequence in slot k owns cells [k L, k L + n) and GroupQueryAttention reads each entry of a
    call from its slot's start; every copy in or out speaks cells ([n, 1, Hkv, D]), as
    HostMemory's does, so snapshots and the engine's cell moves mean the same in every layout."""
    layout = "sequence-slots"

    def __init__(self, slots: int):
        self.slots = slots

    def slot_length(self, capacity: int) -> int:
        """Cells of one slot in a cache of `capacity` cells (a multiple of the slots)."""
        if capacity % self.slots:
            raise ValueError(f"{capacity} cells do not split into {self.slots} equal slots")
        return capacity // self.slots

    def alloc(self, shape: tuple, dtype) -> np.ndarray:
        if len(shape) != 4 or shape[1] != 1:
            raise ValueError(f"a slotted cache holds [cells, 1, Hkv, D] tensors, not {list(shape)}")
        cells, _, heads, dim = shape
        return super().alloc((self.slots, heads, self.slot_length(cells), dim), dtype)

    @staticmethod
    def _where(buf: np.ndarray, cells) -> tuple[np.ndarray, np.ndarray]:
        cells = np.asarray(cells, np.int64)
        return cells // buf.shape[2], cells % buf.shape[2]

    def _get(self, buf: np.ndarray, cells) -> np.ndarray:
        k, i = self._where(buf, cells)
        return buf[k, :, i][:, None]  # [n, 1, Hkv, D] (a copy: fancy indexing)

    def _put(self, buf: np.ndarray, cells, arr: np.ndarray) -> None:
        k, i = self._where(buf, cells)
        buf[k, :, i] = arr[:, 0]

    def read(self, buf: np.ndarray, n: int) -> np.ndarray:
        return self._get(buf, np.arange(n))

    def write(self, buf: np.ndarray, arr: np.ndarray) -> None:
        self._put(buf, np.arange(len(arr)), arr)

    def read_rows(self, buf: np.ndarray, start: int, stop: int) -> np.ndarray:
        return self._get(buf, np.arange(start, stop))

    def write_rows(self, buf: np.ndarray, start: int, arr: np.ndarray) -> None:
        self._put(buf, np.arange(start, start + len(arr)), arr)

    def write_slots(self, buf: np.ndarray, slots: np.ndarray, arr: np.ndarray) -> None:
        self._put(buf, slots, arr)

    def move_rows(self, buf: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        if self._one_run(buf, src) and self._one_run(buf, dst):  # a prefix copied to another slot: two slices
            (ks, i), (kd, j), n = self._where(buf, src[:1]), self._where(buf, dst[:1]), len(src)
            buf[kd[0], :, j[0]: j[0] + n] = buf[ks[0], :, i[0]: i[0] + n]  # numpy copies an overlap through a buffer
            return
        self._put(buf, dst, self._get(buf, src))  # every source gathered before any is written

    @staticmethod
    def _one_run(buf: np.ndarray, cells: np.ndarray) -> bool:
        """`cells` are consecutive and inside one slot."""
        return cells.size > 0 and cells[-1] - cells[0] == cells.size - 1 and bool(np.all(np.diff(cells) == 1)) \
            and cells[0] // buf.shape[2] == cells[-1] // buf.shape[2]


def _malloc_trim():
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_TRIM = _malloc_trim()
CAN_TRIM = _TRIM is not None  # glibc: freed heap can be handed back


def give_memory_back() -> bool:
    """Hand freed heap memory back to the system (glibc's malloc_trim); False where there is none.
    Python's and onnx's freed objects stay in the heap otherwise, counted in the RSS."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
