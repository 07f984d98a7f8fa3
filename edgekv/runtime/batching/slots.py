"""Fused slots: serve's KV on onnxruntime's GroupQueryAttention (docs/serve.md, "Fused slots").

The cache is SlotMemory's: K slots of L = C / K cells, each sequence in a slot of its own from
cell 0 (llama-server's --parallel). A step's decode tokens go in one call whose entries are
consecutive slots (the ones between that decode nothing are idle entries: query_seqlens 0, their
cells untouched); each prompt piece goes in a call of its own (a [B, S] call computes B x S rows
of projections, so a 128-token chunk beside decode tokens would multiply the step's work). Every
entry reads only its own slot from its first cell, so a request's arithmetic does not depend on
what else runs: batched = alone by construction (tests/test_fused_serve.py checks it bit for bit).

`SlotKV` has the KV manager's interface (kv.py), so the scheduler, the post-processing and the
batcher are the cell pool's own; `SlotPool` answers the scheduler's questions about cells (free,
cached, evict). What the slot layout does not do: compaction (nothing fragments), preemption
(a request's slot holds all it may add: the scheduler's reservations never run short, see
`SlotPool`), chat's held sequences and turns (chat keeps the cell pool). The prefix cache is per
slot: a finished request's slot keeps its tokens as a cached prefix until the slot is needed, a
new request takes the free slot sharing its longest prefix (in place) or copies the cells of the
longest one from any slot (a running request's prompt included) into its own."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
import numpy as np

from edgekv.errors import EdgeKVError
from edgekv.runtime.batching.kv import KVCounters
from edgekv.runtime.batching.plan import Piece, SlotCall
from edgekv.runtime.batching.poolseq import PoolSequence
from edgekv.runtime.batching.turns import NoTurns
from edgekv.runtime.batching.window_rings import NoWindowRings
from edgekv.runtime.cache import KVCache
from edgekv.runtime.pool import Prefix


@dataclass
class SlotCounters(KVCounters):
    copied_cells: int = 0  # prefix cells copied from another slot (what sharing a prefix costs here)


class SlotPool:
    """Who holds which slot, and the prefix each slot's first cells hold, in the cell pool's
    terms for the scheduler (`free`, `cached_only`, `evict_*`, `used`). Why the scheduler's
    reservations always fit: a request in a slot holds at most L cells (its limit), so every
    slot's cells minus its own request's reservation is >= 0, and a free slot's are L >= any
    admission's need; nothing is ever preempted."""

    def __init__(self, slots: int, length: int, max_prefixes: int):
        self.slots, self.length, self.capacity = slots, length, slots * length
        self.max_prefixes = max_prefixes
        self.owner: list[PoolSequence | None] = [None] * slots
        # per slot: the tokens (and their tenant) whose K/V its cells [0, len) hold, matchable by
        # a later request; a free slot's entries in least recently used order
        self.entry: list[Prefix | None] = [None] * slots
        self.lru: OrderedDict[int, None] = OrderedDict()

    # -- counts (cells)
    def live(self) -> int:
        return sum(s.n for s in self.owner if s is not None)

    def cached_only(self) -> int:
        return sum(len(self.entry[k]) for k in self.lru)

    def used(self) -> int:
        return self.live() + self.cached_only()

    def free(self) -> int:
        return self.capacity - self.used()

    # -- slots
    def slot_of(self, seq: PoolSequence) -> int:
        for k, s in enumerate(self.owner):
            if s is seq:
                return k
        raise ValueError("this sequence holds no slot")

    def best_source(self, ids: list[int], tenant: str) -> tuple[int, int | None]:
        """(length, slot) of the longest prefix of `ids` some slot holds for `tenant` (0, None: none)."""
        best, where = 0, None
        arr = np.asarray(ids, np.int64)
        for k, key in enumerate(self.entry):
            if key is None or key.tenant != tenant:
                continue
            n = min(len(key), len(arr))
            same = np.asarray(key[:n], np.int64) == arr[:n]
            m = n if same.all() else int(np.argmin(same))
            if m > best:
                best, where = m, k
        return best, where

    def take(self, seq: PoolSequence, source: int | None) -> int:
        """A free slot for `seq`: `source` itself when it is free (its prefix is used in place),
        else one holding no prefix, else the least recently used one's; its old prefix is dropped."""
        free = [k for k, s in enumerate(self.owner) if s is None]
        if not free:
            raise RuntimeError("no free slot although the scheduler admits only as many requests as slots")
        if source in free:
            k = source
        else:
            bare = [k for k in free if k not in self.lru]
            k = bare[0] if bare else next(iter(self.lru))
            self.entry[k] = None
        self.lru.pop(k, None)
        self.owner[k] = seq
        return k

    def give_back(self, k: int, keep: Prefix | None) -> None:
        """Slot k is free again; `keep` (else what it held already) stays matchable until it is needed."""
        self.owner[k] = None
        if keep is not None:
            self.entry[k] = keep
        if self.entry[k] is not None and self.max_prefixes > 0:
            self.lru[k] = None
            while len(self.lru) > self.max_prefixes:
                self.evict_one()
        else:
            self.entry[k] = None

    def remember(self, k: int, key: Prefix) -> None:
        if self.max_prefixes > 0 and key:
            self.entry[k] = key

    def hold(self, k: int, key: Prefix | None) -> None:
        """What slot k's first cells are known to hold now (None: nothing matchable)."""
        self.entry[k] = key if self.max_prefixes > 0 and key else None

    def evict_one(self) -> bool:
        """Forget the least recently used free slot's prefix; False when none is held."""
        if not self.lru:
            return False
        k, _ = self.lru.popitem(last=False)
        self.entry[k] = None
        return True

    evict_freeing = evict_one  # a free slot's prefix is only the cache's: dropping it frees its cells


class SlotKV:
    """The KV manager of a slotted cache (the cell pool's interface, kv.py): each sequence's
    cells are its slot's first ones; it owns the sequences' cells and the slots' prefixes."""

    def __init__(self, cache: KVCache, max_prefixes: int):
        self.cache = cache
        slots = cache.memory.slots
        length = cache.memory.slot_length(cache.capacity)
        self.capacity = cache.capacity
        self.limit = min(length, cache.max_positions)  # cells and positions of one sequence: its slot
        self.limit_words = f"a slot holds {self.limit} ({cache.capacity} cells in {slots} slots)"
        self.max_sequences = slots
        self.pool = SlotPool(slots, length, max_prefixes)
        self.turns = NoTurns()
        self.window_rings = NoWindowRings()  # every slot keeps every position
        self.sequences: list[PoolSequence] = []
        self.kept: list[PoolSequence] = []  # never any: chat keeps the cell pool
        self.counters = SlotCounters()

    # -- sequences
    def new(self, kept: bool = False) -> PoolSequence:
        if kept:
            raise EdgeKVError("a held sequence (chat) needs the cell pool, not fused slots")
        seq = PoolSequence(self.limit, self.cache.max_positions)
        self.sequences.append(seq)
        return seq

    def attach_prefix(self, seq: PoolSequence, ids: list[int], tenant: str) -> int:
        """A new sequence takes a slot and the longest prefix of `ids` any slot holds for
        `tenant` (in place when that slot is free, else its cells copied); its length."""
        k, source = self.pool.best_source(ids, tenant)
        slot = self.pool.take(seq, source)
        base = slot * self.pool.length
        if k and source != slot:
            src = source * self.pool.length
            self.cache.move_cells(np.arange(src, src + k), np.arange(base, base + k))
            self.counters.copied_cells += k
        self.pool.hold(slot, Prefix(ids[:k], tenant) if k else None)  # its cells after k become the new request's
        seq._set(list(range(base, base + k)), ids[:k])
        return k

    def evict_one(self) -> bool:
        return self.pool.evict_one()

    def evict_freeing(self) -> bool:
        return self.pool.evict_freeing()

    def remember_prompt(self, seq: PoolSequence, feed: list[int], tenant: str) -> None:
        """A prompt wholly in its slot: matchable by later requests (copied from here while it runs)."""
        self.pool.remember(self.pool.slot_of(seq), Prefix(feed, tenant))

    def release(self, seq: PoolSequence, remember: list[int] | None = None, tenant: str = "") -> None:
        k = self.pool.slot_of(seq)
        keep = Prefix(remember[: seq.n], tenant) if remember is not None else None
        self.pool.give_back(k, keep)
        seq._set([], [])
        self.sequences.remove(seq)

    def reset(self, seq: PoolSequence) -> None:
        seq._set([], [])

    def snapshot(self, seq: PoolSequence) -> dict[str, np.ndarray]:
        return self.cache.read_cells(seq.cells)

    def _cell_pool_only(self, *_):
        raise EdgeKVError("held sequences (chat: undo, /load) need the cell pool, not fused slots")

    unhold = truncate = restore = _cell_pool_only

    def memory(self) -> dict[str, int]:
        """The KV's bytes (kv.py's `memory`): the slots' buffers, every position of every layer."""
        return {"kv_bytes": self.cache.nbytes, "kv_local_rings": 0, "kv_prefix_window_bytes": 0}

    # -- a step
    def past(self) -> int:
        """The most cells a call's entry reads (its own slot's filled ones)."""
        return max((s.n for s in self.pool.owner if s is not None), default=0)

    def tidy(self, want: int) -> None:
        pass  # slots do not fragment

    def protect(self, call) -> None:
        pass  # no turns here

    def place(self, pieces: list[Piece]):
        """The decode pieces in one call over consecutive slots, then each prompt piece in its own."""
        slot = {id(p.seq): self.pool.slot_of(p.seq) for p in pieces}
        decode = sorted((p for p in pieces if p.decode), key=lambda p: slot[id(p.seq)])
        if decode:
            first, last = slot[id(decode[0].seq)], slot[id(decode[-1].seq)]
            entries: list = [None] * (last - first + 1)
            for p in decode:
                entries[slot[id(p.seq)] - first] = p
            yield SlotCall.of(first, entries)
        for p in pieces:
            if not p.decode:
                yield SlotCall.of(slot[id(p.seq)], [p])

    def commit(self, call: SlotCall) -> None:
        """A call appended its entries' tokens to their slots: the sequences hold them."""
        for p in call.pieces:
            n, base = p.seq.n, self.pool.slot_of(p.seq) * self.pool.length
            p.seq._extend(range(base + n, base + n + len(p.tokens)), p.tokens)
