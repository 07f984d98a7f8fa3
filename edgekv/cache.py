"""KVCache: every KV buffer allocated once, slot-major, for a capacity chosen at run time.

Layout per graph tensor: [capacity, B, Hkv, D] (values) or [capacity, B, Hkv] (scales). Slot
`i` of every buffer belongs to the same token. The filled prefix buf[:n] is contiguous, so a
backend binds only that as `past.*`, and the new tokens' region buf[n:n+S] is contiguous, so
`present.*` is written there directly (zero-copy append)."""
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


class KVCache:
    def __init__(self, bundle: Bundle, capacity: int, batch: int = 1):
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
            spec = self.scheme.tensors[0] if not name.endswith("_scale") else self.scheme.tensors[1]
            dtype = NP_DTYPES[float_dtype if spec.dtype == "float" else spec.dtype]
            shapes[name] = (spec.shape(capacity, batch, m["n_kv_heads"], m["head_dim"]), dtype)
        need = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in shapes.values())
        free = available_memory()
        if free is not None and need > free:
            raise EdgeKVError(f"KV cache for --ctx {capacity} needs {need / 2**20:.1f} MiB, only "
                              f"{free / 2**20:.1f} MiB free; use a smaller --ctx")
        # np.zeros maps untouched pages lazily; fill so the memory is really ours from the start
        self.buffers = {}
        for name, (shape, dtype) in shapes.items():
            buf = np.empty(shape, dtype)
            buf.fill(0)
            self.buffers[name] = buf
        self.nbytes = need
        self.bytes_per_token = need // capacity
        self.n = 0  # filled slots
        # the graph's key_mask input: which of the P + S keys exist (all, for a linear cache)
        self.key_mask = np.ones((batch, capacity), dtype=np.bool_)

    def key_mask_for(self, s: int) -> np.ndarray:
        return self.key_mask[:, : self.n + s]

    def used_bytes(self) -> int:
        return self.n * self.bytes_per_token

    def reset(self) -> None:
        self.n = 0

    def truncate(self, n: int) -> None:
        """Forget everything after the first n slots (undo / regenerate)."""
        if not 0 <= n <= self.n:
            raise ValueError(f"cannot truncate a cache of {self.n} tokens to {n}")
        self.n = n

    def room(self) -> int:
        return self.capacity - self.n

    def check_room(self, s: int) -> None:
        if s > self.room():
            raise ContextOverflow(f"context full: {self.n} + {s} tokens exceed the cache capacity of "
                                  f"{self.capacity} (raise --ctx)")

    def snapshot(self) -> dict[str, np.ndarray]:
        return {name: buf[: self.n].copy() for name, buf in self.buffers.items()}

    def restore(self, snap: dict[str, np.ndarray]) -> None:
        n = {v.shape[0] for v in snap.values()}
        if len(n) != 1 or set(snap) != set(self.buffers):
            raise EdgeKVError("snapshot does not match this cache's layout")
        n = n.pop()
        if n > self.capacity:
            raise ContextOverflow(f"snapshot holds {n} tokens, more than the cache capacity {self.capacity}")
        for name, buf in self.buffers.items():
            buf[:n] = snap[name]
        self.n = n
