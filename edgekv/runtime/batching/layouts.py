"""Where a sequence's K/V live, by the cache's layout (KVCache.layout): cells of one shared pool
(kv.py: every backend's run_cells), or a slot of its own (slots.py: fused slots, ort-cpu's
run_slots; docs/serve.md). Each layout gives the batcher its KV manager and its step runner."""
from __future__ import annotations

from edgekv.runtime.batching.kv import KVManager
from edgekv.runtime.batching.runner import SlotRunner, StepRunner
from edgekv.runtime.batching.slots import SlotKV
from edgekv.runtime.cache import KVCache
from edgekv.runtime.memory import SlotMemory


def cell_pool(backend, cache: KVCache, max_prefixes: int):
    """The unified cell pool's KV manager and step runner (every backend's run_cells)."""
    kv = KVManager(cache, backend.past_bucket, max_prefixes)
    return kv, StepRunner(backend, cache, kv.window_rings)


def fused_slots(backend, cache: KVCache, max_prefixes: int):
    """Fused slots' KV manager and step runner (ort-cpu's run_slots; docs/serve.md)."""
    return SlotKV(cache, max_prefixes), SlotRunner(backend, cache)


MAX_PREFIXES = 32  # prompts the prefix cache keeps (least recently used dropped first)
KV_LAYOUTS = {SlotMemory.layout: fused_slots}  # any other layout: the cell pool
