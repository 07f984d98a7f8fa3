"""The calls of the graph as written (ort-cpu, ort-cuda without the fused rewrite): the cache is
slot-major, the past bound at its filled slots rounded up to the backend's bucket (the tail
masked through key_mask), present.* written at the call's cells (docs/runtime.md, "The decode step")."""
from __future__ import annotations

import ctypes

import numpy as np

from edgekv.errors import BackendUnavailable, EdgeKVError
from edgekv.format.bundle import LOCAL_MASK, Bundle
from edgekv.runtime.cache import KVCache


class PlainCalls:
    """`be`: the backend (its session, binding, memory, flags); `past_bucket`: its bucket."""

    def __init__(self, be, past_bucket: int):
        self.be, self.past_bucket = be, past_bucket
        self.max_tokens_per_call = be.max_tokens_per_call
        # a single stream's cache may keep only the local layers' window (KVCache(windowed=True)):
        # host memory binds the ring; device memory keeps the full capacity
        self.windows_cache = be.device == "cpu"

    def memory(self):
        return self.be.make_memory()

    def expected_inputs(self, bundle: Bundle) -> set[str]:
        return set(bundle.manifest["io"]["inputs"]) | set(bundle.manifest["io"]["past"])

    def run_cells(self, cache: KVCache, past: int, write: int, input_ids: np.ndarray, position_ids: np.ndarray,
                  key_mask: np.ndarray, logits_index: np.ndarray,
                  local_key_mask: np.ndarray | None = None, ring: tuple | None = None) -> np.ndarray:
        if cache.local_ring is not None:
            return self.call(cache, past, write, input_ids, position_ids, key_mask, logits_index, local_key_mask,
                             cache.local_ring * cache.rings, ring)
        return self.call(cache, past, write, input_ids, position_ids, key_mask, logits_index, local_key_mask)

    def call(self, cache: KVCache, past: int, write: int, input_ids: np.ndarray, position_ids: np.ndarray,
             key_mask: np.ndarray, logits_index: np.ndarray, local_key_mask: np.ndarray | None = None,
             local_past: int | None = None, ring: tuple | None = None) -> np.ndarray:
        """One graph call: past = slots [0, past), present to slots [write, write + S); a windowed
        cache's local layers: past = their slots [0, local_past), and the call's token rows ring[0]
        go to their ring slots ring[1]."""
        be = self.be
        b, s = input_ids.shape
        small = be.binding.small(s, logits_index.shape[1], past, be.local_mask, local_past)
        np.copyto(small["input_ids"], input_ids)
        np.copyto(small["position_ids"], position_ids)
        np.copyto(small["logits_index"], logits_index)
        np.copyto(small["key_mask"], key_mask)
        if be.local_mask:
            if local_key_mask is None:
                raise EdgeKVError(f"{be.name}: this graph has sliding-window layers and needs their {LOCAL_MASK}")
            np.copyto(small[LOCAL_MASK], local_key_mask)
        be.binding.past(cache, past, local_past)
        staged = s == 1 and be.stage_present
        if staged:
            stage = be.binding.staged_present(cache)
        else:
            scratch = be.binding.present_at(cache, write, s)
        logits = be.binding.logits_for(b, logits_index.shape[1])
        be.binding.run(be.session)
        if staged:  # by address: the cache's memory may be any host memory (numpy, OrtValues)
            local_slot = int(ring[1][0]) if ring else write
            for base, row, src, local in stage:
                ctypes.memmove(base + (local_slot if local else write) * row, src, row)
        elif scratch:  # the local layers' kept rows into their ring
            for name, rows in scratch.items():
                cache.write_local(name, ring[1], rows[ring[0]])
        return logits

    def slot_memory(self, slots: int):
        raise BackendUnavailable(f"fused slots need the fused graph; {self.be.attention}")

    def run_slots(self, cache: KVCache, *args) -> np.ndarray:
        raise EdgeKVError(f"{self.be.name}: run_slots needs a slotted cache (memory=backend.slot_memory(k))")
