"""Binding: what an onnxruntime IOBinding holds for one backend, changed only where it changed
(docs/runtime.md, "The decode step"). It owns the binding and every array bound by address: the
small inputs, the one-token call's present.* staging arrays, the logits, the fused calls' feeds.
Each part is keyed by what it holds; a key is dropped before rebinding, so a Ctrl-C half-way
through leaves that part to be bound whole on the next call, never taken for done. A cache is
held by a weak reference: a finished stream's cache is freed with it, not kept by the last
binding (45 MiB at 4,096 cells of the default model), and a dead one matches no later cache."""
from __future__ import annotations

import weakref

import numpy as np

from edgekv.format.bundle import LOCAL_MASK
from edgekv.runtime.cache import KVCache


def _gone() -> None:
    """What a weak reference to a freed cache returns: the key of nothing bound yet."""
    return None


class Binding:
    def __init__(self, session, device: str, vocab: int, rows: int):
        self.io = session.io_binding()
        self.device = device  # where the cache's buffers are (the small inputs and logits are host arrays)
        self.vocab = vocab
        self.logits = np.empty((1, max(1, rows), vocab), np.float32)
        self._bound: dict[str, tuple | None] = {}  # part -> what it holds: small, past, present, logits
        self._small: dict[str, np.ndarray] = {}
        self._stage: tuple = (_gone,)  # the last cache, its present.* staging arrays [1, 1, Hkv, D|-], their copies
        self._feeds: dict[str, np.ndarray] = {}

    def run(self, session) -> None:
        session.run_with_iobinding(self.io)

    def _host_input(self, name: str, a: np.ndarray) -> None:
        self.io.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)

    def _host_output(self, name: str, a: np.ndarray) -> None:
        self.io.bind_output(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)

    # -- logits [b, k, V]: a contiguous block at the start of one buffer, grown when needed
    def logits_for(self, b: int, k: int) -> np.ndarray:
        if self.logits.shape[0] < b or self.logits.shape[1] < k:
            self.logits = np.empty((max(b, self.logits.shape[0]), max(k, self.logits.shape[1]), self.vocab), np.float32)
        logits = self.logits.reshape(-1)[: b * k * self.vocab].reshape(b, k, self.vocab)
        key = (logits.ctypes.data, logits.shape)
        if self._bound.get("logits") != key:
            self._bound.pop("logits", None)
            self._host_output("logits", logits)
            self._bound["logits"] = key
        return logits

    # -- the graph as written
    def small(self, s: int, k: int, past: int, local_mask: bool, local_past: int | None = None) -> dict[str, np.ndarray]:
        """The small inputs' own arrays for this call's shapes, bound once per shape (local_past:
        a windowed cache's local layers' slots, local_key_mask's own past)."""
        lp = past if local_past is None else local_past
        if self._bound.get("small") != (s, k, past, lp):
            self._bound.pop("small", None)  # an interrupt half-way must not leave a stale key
            self._small = {"input_ids": np.zeros((1, s), np.int64), "position_ids": np.zeros((1, s), np.int64),
                           "logits_index": np.zeros((1, k), np.int64), "key_mask": np.zeros((1, s, past + s), np.bool_)}
            if local_mask:
                self._small[LOCAL_MASK] = np.zeros((1, s, lp + s), np.bool_)
            for name, a in self._small.items():  # by address: the arrays are overwritten in place
                self._host_input(name, a)
            self._bound["small"] = (s, k, past, lp)
        return self._small

    def past(self, cache: KVCache, past: int, local_past: int | None = None) -> None:
        """past.* as the first `past` slots of every buffer; a windowed cache's local layers as
        their first `local_past` slots."""
        bound = self._bound.get("past")
        if bound and bound[0]() is cache and bound[1:] == (past, local_past):
            return
        self._bound.pop("past", None)  # a Ctrl-C half-way through leaves some bound, some not: rebind all next time
        local = set(cache.local_names)
        for name in cache.names:
            count = local_past if name in local else past
            self.io.bind_input(name, self.device, 0, cache.dtypes[name], cache.slots_shape(name, count),
                               cache.ptr(name, 0))
        self._bound["past"] = (weakref.ref(cache), past, local_past)

    def present_at(self, cache: KVCache, w: int, s: int) -> dict[str, np.ndarray]:
        """present.* straight into the cache at the write slot: the graph writes it in place. A
        windowed cache's local layers get arrays of their own (returned: the caller copies their
        kept rows into the ring after the run; in place they could wrap, or overwrite slots
        the call's earlier tokens still read)."""
        self._bound["present"] = None  # before: a half-done rebinding must not pass for the staged one
        scratch = {name: np.empty(cache.slots_shape(name, s), cache.dtypes[name]) for name in cache.local_names}
        for name in cache.names:
            if name in scratch:
                self._host_output("present" + name[4:], scratch[name])
                continue
            self.io.bind_output("present" + name[4:], self.device, 0, cache.dtypes[name], cache.slots_shape(name, s),
                                cache.ptr(name, w))
        return scratch

    def staged_present(self, cache: KVCache) -> list[tuple[int, int, int, bool]]:
        """present.* of a one-token call into staging arrays, bound once per cache; returns what
        the copy after the run needs: (buffer address, bytes per slot, staging address, whether
        the buffer is a local layer's ring) each."""
        if self._stage[0]() is not cache:
            arrays = {name: np.zeros(cache.slots_shape(name, 1), cache.dtypes[name]) for name in cache.names}
            local = set(cache.local_names)
            copies = [(cache.ptr(name, 0), cache.row_bytes[name], a.ctypes.data, name in local)
                      for name, a in arrays.items()]
            self._stage = (weakref.ref(cache), arrays, copies)
        _, arrays, copies = self._stage
        bound = self._bound.get("present")
        if not (bound and bound[0]() is cache):
            self._bound.pop("present", None)
            for name, st in arrays.items():
                self._host_output("present" + name[4:], st)
            self._bound["present"] = (weakref.ref(cache),)
        return copies

    # -- the fused graph: host arrays of each call, and the cache bound as past and present at once
    def feeds(self, feeds: dict[str, np.ndarray]) -> None:
        self._feeds = feeds  # kept alive: bound by address
        for name, a in feeds.items():
            self._host_input(name, a)

    def whole_cache(self, cache: KVCache) -> None:
        """Every buffer whole as both its past and its present (one buffer, one address)."""
        bound = self._bound.get("past")
        if bound and bound[0]() is cache:
            return
        self._bound.pop("past", None)
        memory = cache.memory
        for name, buf in cache.buffers.items():
            # by the memory's own address and device: host numpy arrays, or ort-cuda's device
            # OrtValues (gpu.OrtValueHeadMajorMemory), which onnxruntime must not copy per call
            shape = memory.shape(buf) if hasattr(memory, "shape") else list(buf.shape)
            ptr, dtype = memory.ptr(buf), cache.dtypes[name]
            self.io.bind_input(name, memory.device, 0, dtype, shape, ptr)
            self.io.bind_output("present" + name[4:], memory.device, 0, dtype, shape, ptr)
        self._bound["past"] = (weakref.ref(cache),)

    def slot_block(self, cache: KVCache, first: int, count: int) -> None:
        """past.* and present.* as slots [first, first + count) of every buffer (one address each)."""
        key = (weakref.ref(cache), first, count)  # weak refs compare equal while their object lives
        if self._bound.get("past") == key:
            return
        self._bound.pop("past", None)
        memory = cache.memory
        for name, buf in cache.buffers.items():
            if hasattr(memory, "block"):  # device memory (gpu.OrtValueSlotMemory): by address, never copied
                ptr, shape = memory.block(buf, first, count)
                self.io.bind_input(name, memory.device, 0, cache.dtypes[name], shape, ptr)
                self.io.bind_output("present" + name[4:], memory.device, 0, cache.dtypes[name], shape, ptr)
                continue
            view = buf[first: first + count]  # [count, Hkv, L, D]: consecutive slots are one block
            self._host_input(name, view)
            self._host_output("present" + name[4:], view)
        self._bound["past"] = key
