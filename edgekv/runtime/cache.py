"""KVCache: every KV buffer allocated once, cell-major, for a capacity chosen at run time.

Layout per graph tensor: [capacity, 1, Hkv, D] (values) or [capacity, 1, Hkv] (scales). Cell
`i` of every buffer belongs to the same token. The cache is only the buffers; which cells a
sequence holds, and in what order, is the batcher's (its KV manager, batching/kv.py; the cells'
owners are the CellPool's, pool.py). A call binds cells [0, past) as `past.*` (ort: rounded up to
a bucket, the cells no running sequence holds masked) and writes `present.*` to a free run of
cells [w, w + S) directly (zero-copy append). (The methods still say "slots": a slot here is a
cell's row in a buffer; serve's fused slots are memory.SlotMemory's, another thing.)

Where the buffers live, and how, is the backend's choice (`backend.memory`, a KVMemory): host
memory (numpy) for ort-cpu, device memory for the GPU backends; the fused graph's buffers are
head-major [1, Hkv, capacity + spare, D] (memory.HeadMajorMemory), and every copy in or out of
them still speaks cells, so the cell operations below mean the same in either layout.

A windowed cache (`windowed=True`, a format-4 bundle with local layers: docs/models.md) gives
the local layers' buffers `rings` rings of `local_ring` slots, [rings * local_ring, 1, Hkv, D],
one per running PoolSequence (batching/window_rings.py: a stream has one, chat's kept sequence
one, serve one per request). The cell operations speak the global layers' cells
(`cell_names`); the rings are copied whole (`read_ring`, `write_ring`)."""
from __future__ import annotations

import numpy as np

from edgekv.errors import EdgeKVError
from edgekv.format.bundle import Bundle, io_names, layer_of, local_slots
from edgekv.runtime.memory import HostMemory, KVMemory, MovesRows, RowMemory, runs

NP_DTYPES = {"int8": np.int8, "uint8": np.uint8, "float16": np.float16, "float32": np.float32}
DEFAULT_CAPACITY = 2048  # cells, when no --ctx is given (capped at the bundle's verified context)


def default_capacity(bundle: Bundle) -> int:
    return min(DEFAULT_CAPACITY, bundle.max_context)


class KVCache:
    def __init__(self, bundle: Bundle, capacity: int, memory: KVMemory | None = None, windowed: bool = False,
                 rings: int = 1, margin: int = 0):
        """`windowed`: the local layers keep `rings` rings of their window's W - 1 slots (capped at
        the capacity) plus `margin` (what a kept sequence may truncate without losing its window)."""
        if capacity < 1:
            raise EdgeKVError(f"the cache capacity must be at least 1 (got {capacity})", setting="capacity",
                              fix="raise {}")
        self.memory = memory or HostMemory()
        span = capacity // self.memory.slots  # the most cells one sequence can use
        if span > bundle.max_context:
            cells = f"a cache of {capacity} cells" if self.memory.slots == 1 else \
                f"a sequence slot of {span} cells ({capacity} in {self.memory.slots} slots)"
            raise EdgeKVError(f"{cells} exceeds the {bundle.max_context} tokens this bundle was "
                              f"verified for", setting="max_context", fix="re-export with a larger {}")
        m = bundle.model
        self.capacity = capacity
        self.max_positions = bundle.max_context
        self.scheme = bundle.scheme
        self.window = bundle.window  # the local layers' sliding window: the graph takes local_key_mask (None: no such layers)
        self.names = io_names(m["n_layers"], self.scheme)["past"]
        # the local layers' slots (None: every buffer has `capacity`); only for one stream's
        # cache, in host slot-major memory, of a graph whose local past has its own length
        self.local_ring, self.rings = None, 0
        if windowed and bundle.windowed and self.memory.slots == 1 and self.layout == "slots" and rings > 0:
            self.local_ring, self.rings = min(local_slots(bundle.window), capacity) + margin, rings
        local = set(bundle.local_layers) if self.local_ring else set()
        self.local_names = [name for name in self.names if layer_of(name) in local]
        self.cell_names = [name for name in self.names if name not in self.local_names]  # the global layers'
        float_dtype = bundle.dtype
        shapes = {}
        for name in self.names:
            spec = self.scheme.spec_of(name)
            dtype = NP_DTYPES[float_dtype if spec.dtype == "float" else spec.dtype]
            slots = self.local_ring * self.rings if name in self.local_names else capacity
            shapes[name] = (spec.shape(slots, 1, m["n_kv_heads"], m["head_dim"]), dtype)
        need = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in shapes.values())
        # refused before anything is allocated: the memory's free bytes are the tightest of the
        # limits it knows (host memory: MemAvailable, a cgroup's limit, RLIMIT_AS/RLIMIT_DATA)
        free = self.memory.free_bytes()
        if free is not None and need > free:
            raise self._too_large(capacity, need, free)
        self.buffers = {}
        try:
            for name, (shape, dtype) in shapes.items():
                self.buffers[name] = self.memory.alloc(shape, dtype)
        except MemoryError:  # a limit the check could not see, or memory taken since: still one line
            self.buffers.clear()
            raise self._too_large(capacity, need, self.memory.free_bytes()) from None
        self.shapes = {name: shape for name, (shape, _) in shapes.items()}
        self.dtypes = {name: np.dtype(dtype) for name, (_, dtype) in shapes.items()}
        # bytes of one slot of each buffer: slot i of `name` starts at ptr + i * row_bytes
        self.row_bytes = {name: int(np.prod(shape[1:])) * self.dtypes[name].itemsize
                          for name, shape in self.shapes.items()}
        self.nbytes = need
        # the local rings' bytes are fixed (a ring in full use once it is full); the rest grows per token
        self.local_row = sum(self.row_bytes[name] for name in self.local_names)  # one slot of every local buffer
        self.local_bytes = self.local_row * (self.local_ring or 0) * self.rings
        self.bytes_per_token = (need - self.local_bytes) // capacity

    def _too_large(self, capacity: int, need: int, free: int | None) -> EdgeKVError:
        """The refusal of a cache that does not fit: the bytes it needs and those available."""
        note = getattr(self.memory, "free_note", lambda: "")()  # reads the limits' files once
        why = f": {note}" if note else ""
        left = (f"only {free / 2**20:.1f} MiB free on {self.memory.device} ({free} bytes{why})" if free is not None
                else f"the allocation failed on {self.memory.device}")
        return EdgeKVError(f"a KV cache of {capacity} cells needs {need / 2**20:.1f} MiB ({need} bytes), {left}",
                           setting="capacity", fix="use a smaller {}")

    def slots_of(self, name: str, count: int) -> int:
        """Of `count` slots, those buffer `name` has (a local layer's ring holds at most its own)."""
        return min(count, self.local_ring) if name in self.local_names else count

    def write_local(self, name: str, slots: np.ndarray, rows: np.ndarray) -> None:
        """Copy rows [k, 1, Hkv, D] to the given (distinct) slots of a local layer's buffer, in order."""
        self.memory.write_slots(self.buffers[name], np.asarray(slots, np.int64), rows)

    def read_ring(self, ring: int) -> dict[str, np.ndarray]:
        """Host copies of ring `ring`'s slots of every local buffer."""
        a = ring * self.local_ring
        return {name: self.memory.read_rows(self.buffers[name], a, a + self.local_ring) for name in self.local_names}

    def write_ring(self, ring: int, rows: dict[str, np.ndarray]) -> None:
        """Put back what `read_ring` copied."""
        for name in self.local_names:
            self.memory.write_rows(self.buffers[name], ring * self.local_ring, rows[name])

    @property
    def layout(self) -> str:
        """"slots" ([capacity, 1, Hkv, D], slot-major) or "heads" (HeadMajorMemory's BNSH, the fused graph's)."""
        return getattr(self.memory, "layout", "slots")

    def ptr(self, name: str, slot: int) -> int:
        """Address of slot `slot` of buffer `name` (host or device memory; slot-major layout: in
        a head-major buffer a slot is not one run of bytes, only the buffer's start is)."""
        if slot and self.layout != "slots":
            raise ValueError(f"slot {slot} of a {self.layout}-major cache has no single address")
        return self.memory.ptr(self.buffers[name]) + slot * self.row_bytes[name]

    def slots_shape(self, name: str, count: int) -> list[int]:
        return [count] + list(self.shapes[name][1:])

    def used_bytes(self, slots: int) -> int:
        """Bytes a sequence of `slots` tokens holds (in a windowed cache: its ring's filled slots too)."""
        return slots * self.bytes_per_token + min(slots, self.local_ring or 0) * self.local_row

    def read(self, n: int) -> dict[str, np.ndarray]:
        """Host copies of the first n slots of every buffer (a snapshot)."""
        return {name: self.memory.read(self.buffers[name], n) for name in self.cell_names}

    @property
    def reads_rows(self) -> bool:
        """The memory copies slot ranges (a RowMemory)."""
        return isinstance(self.memory, RowMemory)

    def read_rows(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Host copies of slots [start, stop) of every buffer."""
        return {name: self.memory.read_rows(self.buffers[name], start, stop) for name in self.cell_names}

    def write_rows(self, start: int, rows: dict[str, np.ndarray]) -> None:
        """Copy `rows` (from read_rows) back to the slots from `start` on."""
        for name in self.cell_names:
            self.memory.write_rows(self.buffers[name], start, rows[name])

    def read_cells(self, cells) -> dict[str, np.ndarray]:
        """Host copies of the given slots of every buffer, in that order."""
        cells = np.asarray(cells, np.int64)
        if not self.reads_rows:  # a memory that reads from the start only (ort-cuda's OrtValues)
            whole = self.read(int(cells.max()) + 1 if cells.size else 0)
            return {name: v[cells] for name, v in whole.items()}
        parts = [self.read_rows(int(a), int(b)) for a, b in runs(cells)]
        return {name: np.concatenate([p[name] for p in parts]) if parts else
                np.zeros(self.slots_shape(name, 0), self.dtypes[name]) for name in self.cell_names}

    def write_cells(self, cells, snap: dict[str, np.ndarray]) -> None:
        """Copy a snapshot's slots (checked with `slots_in`) to the given slots, in that order."""
        cells = np.asarray(cells, np.int64)
        if not self.reads_rows:
            whole = self.read(self.capacity)
            for name in self.cell_names:
                whole[name][cells] = snap[name]
            self.write(whole)
            return
        for name in self.cell_names:
            self.memory.write_slots(self.buffers[name], cells, snap[name])

    def move_cells(self, src, dst) -> None:
        """Copy slot src[i] to slot dst[i] in every buffer, every source read before any is
        written (a permutation's swaps are safe): the memory's own move where it has one, else
        the whole buffer through the host."""
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        if not src.size:
            return
        moves = isinstance(self.memory, MovesRows)  # once per call, not per buffer: ~15 µs a Protocol check
        for buf in (self.buffers[name] for name in self.cell_names):
            if moves:
                self.memory.move_rows(buf, src, dst)
            else:
                whole = self.memory.read(buf, self.capacity)
                whole[dst] = whole[src]
                self.memory.write(buf, whole)

    def slots_in(self, snap: dict[str, np.ndarray]) -> int:
        """The slots a snapshot holds; an error unless it fits this cache's layout."""
        n = {v.shape[0] for v in snap.values()}
        if len(n) != 1 or set(snap) != set(self.cell_names):
            raise EdgeKVError("snapshot does not match this cache's layout")
        for name in self.cell_names:
            if snap[name].shape[1:] != tuple(self.shapes[name][1:]) or snap[name].dtype != self.dtypes[name]:
                raise EdgeKVError("snapshot does not match this cache's layout")
        return n.pop()

    def write(self, snap: dict[str, np.ndarray]) -> None:
        """Copy a snapshot (checked with `slots_in`) into the first slots of every buffer."""
        for name in self.cell_names:
            self.memory.write(self.buffers[name], snap[name])

