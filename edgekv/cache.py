"""KVCache: every KV buffer allocated once, slot-major, for a capacity chosen at run time.

Layout per graph tensor: [capacity, B, Hkv, D] (values) or [capacity, B, Hkv] (scales). Slot
`i` of every buffer belongs to the same token. The filled prefix buf[:n] is contiguous, so a
backend binds only that as `past.*`, and the new tokens' region buf[n:n+S] is contiguous, so
`present.*` is written there directly (zero-copy append).

Where the buffers live is the backend's choice: `HostMemory` (numpy, for ort-cpu) here, device
memory for the GPU backends (edgekv/gpu.py). The cache and the backends only use the memory's
four operations (alloc, ptr, read, write), so the pointer arithmetic the GPU backends rely on is
the same code the CPU tests run."""
from __future__ import annotations

import numpy as np

from edgekv.errors import ContextOverflow, EdgeKVError
from edgekv.manifest import Bundle, io_names

NP_DTYPES = {"int8": np.int8, "uint8": np.uint8, "float16": np.float16, "float32": np.float32}


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


class KVCache:
    def __init__(self, bundle: Bundle, capacity: int, batch: int = 1, memory=None):
        if capacity < 1:
            raise EdgeKVError(f"--ctx must be at least 1 (got {capacity})")
        if capacity > bundle.max_context:
            raise EdgeKVError(f"--ctx {capacity} exceeds the {bundle.max_context} tokens this bundle was "
                              f"verified for (re-export with a larger --max-context)")
        m = bundle.model
        self.capacity, self.batch = capacity, batch
        self.scheme = bundle.scheme
        self.names = io_names(m["n_layers"], self.scheme)["past"]
        float_dtype = bundle.dtype
        shapes = {}
        for name in self.names:
            spec = self.scheme.spec_of(name)
            dtype = NP_DTYPES[float_dtype if spec.dtype == "float" else spec.dtype]
            shapes[name] = (spec.shape(capacity, batch, m["n_kv_heads"], m["head_dim"]), dtype)
        need = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in shapes.values())
        self.memory = memory or HostMemory()
        free = self.memory.free_bytes()
        if free is not None and need > free:
            raise EdgeKVError(f"KV cache for --ctx {capacity} needs {need / 2**20:.1f} MiB, only "
                              f"{free / 2**20:.1f} MiB free on {self.memory.device}; use a smaller --ctx")
        self.buffers = {name: self.memory.alloc(shape, dtype) for name, (shape, dtype) in shapes.items()}
        self.shapes = {name: shape for name, (shape, _) in shapes.items()}
        self.dtypes = {name: np.dtype(dtype) for name, (_, dtype) in shapes.items()}
        # bytes of one slot of each buffer: slot i of `name` starts at ptr + i * row_bytes
        self.row_bytes = {name: int(np.prod(shape[1:])) * self.dtypes[name].itemsize
                          for name, shape in self.shapes.items()}
        self.nbytes = need
        self.bytes_per_token = need // capacity
        self.n = 0  # filled slots: the past the graph sees is buf[:n]
        self.w = 0  # write slot: the next call's present.* go to buf[w:w+S] (== n for a linear cache)
        self.sinks = None  # ring mode: slots [0, sinks) are kept forever, [sinks, capacity) wrap
        # the graph's key_mask input: which of the P + S keys exist (all, for a linear cache); a
        # ring binds the whole buffer as past and masks the slots about to be overwritten
        self.key_mask = np.ones((batch, 2 * capacity), dtype=np.bool_)

    # -- ring (StreamingLLM): keep the first `sinks` slots, overwrite the oldest of the rest
    def enable_ring(self, sinks: int) -> None:
        if not 0 <= sinks < self.capacity - 1:
            raise EdgeKVError(f"ring cache: {sinks} sink slots leave no ring in a capacity of {self.capacity}")
        self.sinks = sinks

    @property
    def wrapped(self) -> bool:
        return self.sinks is not None and self.n == self.capacity and self.w < self.n

    def max_write(self) -> int:
        """The most tokens one call may write: up to the end of the buffer (a ring call never
        wraps in the middle; the next one starts again after the sinks)."""
        return self.capacity - self.w

    def advance(self, s: int) -> None:
        """After a call wrote s tokens at the write slot."""
        self.w += s
        self.n = max(self.n, self.w)
        if self.sinks is not None and self.w == self.capacity:
            self.w = self.sinks

    def ptr(self, name: str, slot: int) -> int:
        """Address of slot `slot` of buffer `name` (host or device memory)."""
        return self.memory.ptr(self.buffers[name]) + slot * self.row_bytes[name]

    def slots_shape(self, name: str, count: int) -> list[int]:
        return [count] + list(self.shapes[name][1:])

    def key_mask_for(self, s: int) -> np.ndarray:
        m = self.key_mask[:, : self.n + s]
        if self.sinks is not None:
            m[:] = True
            if self.w < self.n:  # slots being overwritten: their old keys leave the context now
                m[:, self.w: self.w + s] = False
        return m

    def used_bytes(self) -> int:
        return self.n * self.bytes_per_token

    def reset(self) -> None:
        self.n = self.w = 0

    def truncate(self, n: int) -> None:
        """Forget everything after the first n slots (undo / regenerate)."""
        if not 0 <= n <= self.n or self.wrapped:
            raise ValueError(f"cannot truncate a cache of {self.n} tokens to {n}" + (" (the ring has wrapped)" if self.wrapped else ""))
        self.n = self.w = n

    def room(self) -> int:
        """Tokens that still fit (a ring always has room: it overwrites)."""
        return self.capacity - self.n if self.sinks is None else 1 << 62

    def check_room(self, s: int) -> None:
        """s more tokens fit (always, for a ring)."""
        if s > self.room():
            raise ContextOverflow(f"context full: {self.n} + {s} tokens exceed the cache capacity of "
                                  f"{self.capacity} (raise --ctx)")

    def check_write(self, s: int) -> None:
        """One graph call may write s tokens at the write slot (a ring's call may not wrap)."""
        self.check_room(s)
        if s > self.max_write():
            raise ContextOverflow(f"ring cache: a call of {s} tokens would wrap; at most {self.max_write()} now")

    def snapshot(self) -> dict[str, np.ndarray]:
        """The filled slots (a wrapped ring's too: restore it with its write slot `w`)."""
        return {name: self.memory.read(buf, self.n) for name, buf in self.buffers.items()}

    def restore(self, snap: dict[str, np.ndarray], w: int | None = None) -> None:
        n = {v.shape[0] for v in snap.values()}
        if len(n) != 1 or set(snap) != set(self.buffers):
            raise EdgeKVError("snapshot does not match this cache's layout")
        n = n.pop()
        if n > self.capacity:
            raise ContextOverflow(f"snapshot holds {n} tokens, more than the cache capacity {self.capacity}")
        for name, buf in self.buffers.items():
            if snap[name].shape[1:] != tuple(self.shapes[name][1:]) or snap[name].dtype != self.dtypes[name]:
                raise EdgeKVError("snapshot does not match this cache's layout")
            self.memory.write(buf, snap[name])
        self.n = self.w = n
        if w is not None and w != n:  # a ring that had wrapped: the next write goes to its old slot
            if self.sinks is None or not self.sinks <= w < n == self.capacity:
                raise EdgeKVError("snapshot of a wrapped ring does not fit this cache")
            self.w = w
