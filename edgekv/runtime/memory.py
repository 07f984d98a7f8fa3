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


@runtime_checkable
class MovesRows(KVMemory, Protocol):
    """Memory that moves rows itself (the serving pool's compaction), without a whole-buffer copy."""

    def move_rows(self, buf: Any, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy row src[i] to row dst[i], every source read before any row is written."""


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

    # MovesRows: gathered, then scattered, in place
    def move_rows(self, buf: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        buf[dst] = buf[src]
