"""Where KV buffers live: the `KVMemory` protocol every backend's memory follows, and host memory.

The cache and the backends use a memory's four operations (alloc, ptr, read, write), so the
pointer arithmetic the GPU backends rely on is the same code the CPU tests run; memories that
can do better also copy row ranges (`RowMemory`: a chat turn's undo, /save, /load) and move rows
(`MovesRows`: the serving pool's compaction). Device memories
(onnxruntime OrtValues, cuda-python) are in edgekv/runtime/backends/gpu.py."""
from __future__ import annotations

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


def available_memory() -> int | None:
    """Bytes the kernel says it can give us now (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class HostMemory:
    """KV buffers in host RAM as numpy arrays."""
    device = "cpu"
    layout = "slots"  # slot i of a buffer is its i-th row (cache.ptr's arithmetic); HeadMajorMemory: "heads"
    slots = 1

    def free_bytes(self) -> int | None:
        return available_memory()

    def alloc(self, shape: tuple, dtype) -> np.ndarray:
        buf = np.empty(shape, dtype)
        buf.fill(0)  # np.zeros maps pages lazily; touch them so the memory is really ours from the start
        return buf

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
