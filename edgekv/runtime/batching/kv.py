"""The KV manager: one KVCache allocated once, whose slots are cells; the CellPool (pool.py) says
which cells hold what. It owns every PoolSequence's cells (the only writer of them), a ring's
overwrite, where a step's new K/V land (`place`), the past a call binds and compaction; it knows
no requests.

Before a step the pool is compacted where that helps (`tidy`): the sequences' cells low, the
cells only the prefix cache holds at the top, the free cells one run between. The past is cells
[0, the highest a sequence holds), rounded up to the backend's bucket. A step's new tokens land
in a contiguous run of free cells (where the pool is fragmented — a chat turn, which does not
compact — a step is split over several calls).

A windowed pool (cache.local_ring: chat's, docs/models.md) also gives each sequence a window
ring of the local layers' slots for as long as it lives (`new` .. `release`/`unhold`;
window_rings.py), which a turn copies whole. Its prefix cache (serve's) keeps a copy of the ring
beside each entry, and reuses an entry only where that copy holds the window before the match
(prefix_windows.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from edgekv.errors import ContextOverflow, EdgeKVError
from edgekv.runtime.backends.base import bound_past
from edgekv.runtime.batching.plan import Call, Piece
from edgekv.runtime.batching.poolseq import PoolSequence
from edgekv.runtime.batching.turns import Turns
from edgekv.runtime.batching.window_rings import NoWindowRings, WindowRings, split_window
from edgekv.runtime.batching.prefix_windows import PrefixWindows
from edgekv.runtime.cache import KVCache
from edgekv.runtime.memory import runs
from edgekv.runtime.pool import CellPool, Prefix


@dataclass
class KVCounters:
    moved_cells: int = 0
    compaction_seconds: float = 0.0


class KVManager:
    def __init__(self, cache: KVCache, past_bucket: int, max_prefixes: int):
        self.cache, self.capacity, self.past_bucket = cache, cache.capacity, past_bucket
        self.limit = min(self.capacity, cache.max_positions)  # cells and positions of one sequence
        self.limit_words = f"the context holds {self.limit}"
        self.max_sequences = 1 << 30  # as many as the cells hold
        self.pool = CellPool(self.capacity, max_prefixes)
        self.turns = Turns(cache, self.pool)
        self.sequences: list[PoolSequence] = []  # every sequence handed out and not yet released
        self.kept: list[PoolSequence] = []  # of which those held across requests (chat)
        self.counters = KVCounters()
        windowed = cache.local_ring is not None
        self.window_rings = WindowRings(cache) if windowed else NoWindowRings()
        if windowed:  # each running sequence has its own ring
            self.max_sequences = cache.rings
        # a windowed pool's prefix cache: each entry's local layers' window, copied from its ring
        self.windows = PrefixWindows(cache) if windowed else None

    # -- sequences
    def new(self, kept: bool = False) -> PoolSequence:
        seq = PoolSequence(self.limit, self.cache.max_positions)
        self.window_rings.take(seq)
        self.sequences.append(seq)
        if kept:
            self.kept.append(seq)
        return seq

    def _forget(self, seq: PoolSequence) -> None:
        """A sequence is no longer the manager's: its ring goes back."""
        self.sequences.remove(seq)
        self.window_rings.give_back(seq)

    def release(self, seq: PoolSequence, remember: list[int] | None = None, tenant: str = "") -> None:
        """Give a sequence's cells back (`remember`: its token ids, cached for `tenant` first);
        a sequence not kept is no longer the manager's."""
        if remember is not None:
            self._remember(seq, remember[: seq.n], np.asarray(seq.cell_view()), tenant)
        self.reset(seq)
        if seq not in self.kept:
            self._forget(seq)

    def evict_one(self) -> bool:
        """Drop the least recently used cached prefix, and its window copy; False when there is none."""
        return self._evicted(self.pool.evict_one())

    def evict_freeing(self) -> bool:
        """Drop the least recently used cached prefix whose eviction frees a cell (CellPool.evict_freeing),
        and its window copy; False when there is none."""
        return self._evicted(self.pool.evict_freeing())

    def _evicted(self, dropped: bool) -> bool:
        if dropped and self.windows:
            self.windows.follow(self.pool.prefixes)
        return dropped

    def unhold(self, seq: PoolSequence) -> None:
        """A kept sequence's cells back to the pool; it is no longer the manager's (its ring goes back)."""
        self.reset(seq)
        self.kept.remove(seq)
        self._forget(seq)

    def attach_prefix(self, seq: PoolSequence, ids: list[int], tenant: str) -> int:
        """An empty sequence takes the cells of `tenant`'s longest cached prefix of `ids` (a
        windowed pool: the longest whose entry kept the window before it, into its ring); its length."""
        k, key = self.pool.match(ids, tenant, self.windows.serves if self.windows else None)
        if key is None:
            return 0
        cells = self.pool.use(key, k)
        self.pool.take(cells)
        seq._set([int(c) for c in cells], ids[:k])
        if self.windows:
            self.window_rings.put(seq, *self.windows.before(key, k))
        return k

    def remember_prompt(self, seq: PoolSequence, feed: list[int], tenant: str) -> None:
        """A prompt wholly in cells: cached for the next request of `tenant` that starts the same way."""
        self._remember(seq, feed, np.asarray(seq.cell_view()[: len(feed)]), tenant)

    def _remember(self, seq: PoolSequence, ids: list[int], cells: np.ndarray, tenant: str) -> None:
        """Cache the cells of `ids`, the first tokens of `seq`; in a windowed pool with a copy of
        its ring, which holds the window before their end now (its last position is len(ids) - 1)."""
        self.pool.remember(ids, cells, tenant)
        if self.windows is None:
            return
        self.windows.follow(self.pool.prefixes)  # entries the pool evicted or replaced
        key = Prefix(ids, tenant)
        if key in self.pool.prefixes:
            self.windows.keep(key, *self.window_rings.filled(seq))

    def reset(self, seq: PoolSequence) -> None:
        self.pool.drop(seq.cell_view())
        seq._set([], [])
        self.window_rings.forget_from(seq, 0)

    def can_truncate(self, seq: PoolSequence, n: int) -> bool:
        """`truncate(seq, n)` keeps everything the next token sees: a wrapped ring cannot, and a
        windowed pool's ring only while it holds the window's positions before n."""
        return 0 <= n <= seq.n and not seq.wrapped and self.window_rings.holds_window(seq, n)

    def truncate(self, seq: PoolSequence, n: int) -> None:
        if not self.can_truncate(seq, n):
            raise ValueError(f"cannot truncate a sequence of {seq.n} tokens to {n}"
                             + (" (the ring has wrapped)" if seq.wrapped else
                                " (its local layers' ring no longer holds that window)" if 0 <= n <= seq.n else ""))
        cells = seq.cells
        self.pool.drop(cells[n:])
        seq._set(cells[:n], seq.ids[:n])
        self.window_rings.forget_from(seq, n)

    def snapshot(self, seq: PoolSequence) -> dict[str, np.ndarray]:
        return self.cache.read_cells(seq.cells) | self.window_rings.snapshot(seq)

    def restore(self, seq: PoolSequence, snap: dict[str, np.ndarray], ids: list[int], n: int) -> None:
        """Fill an empty sequence with a snapshot (in position order) and the ids it was fed."""
        snap, ring = split_window(snap)
        free = np.flatnonzero(self.pool.refs == 0)
        if free.size < n:
            raise ContextOverflow(f"snapshot holds {n} tokens, {free.size} cells are free", setting="capacity",
                                  fix="raise {}")
        ring = self.window_rings.to_restore(seq, snap, ring, ids, n)  # checked before anything is written
        cells = [int(c) for c in free[:n]]
        self.pool.take(cells)
        for a, b in runs(np.asarray(cells)):
            self.turns.protect(a, b - a)
        self.cache.write_cells(cells, {k: snap[k] for k in self.cache.cell_names})
        seq._set(cells, ids)
        if ring is not None:
            self.window_rings.put(seq, *ring)

    def memory(self) -> dict[str, int]:
        """The KV's bytes (a gauge: /health, /metrics): the pool's buffers (a windowed pool's
        rings among them), its local layers' rings, and the prefix windows' host copies."""
        return {"kv_bytes": self.cache.nbytes, "kv_local_rings": self.cache.rings,
                "kv_prefix_window_bytes": self.windows.nbytes if self.windows else 0}

    # -- a step's cells
    def past(self) -> int:
        """Cells bound as the past: up to the highest cell a sequence holds, rounded up to the
        backend's bucket (ort), so the binding changes once per bucket, not every step; free and
        cached cells inside it stay masked, cached ones above it cost the call nothing."""
        return self.bucket(self.pool.live_high_water())

    def bucket(self, n: int) -> int:
        return bound_past(n, self.past_bucket, self.capacity)

    def place(self, pieces: list[Piece]) -> Iterator[Call]:
        """The step's pieces in as few calls as the free runs of cells allow; each call is
        committed (`commit`) before the next is placed. A ring short of free cells first gives
        up its oldest tokens after the sinks, as many as its piece lacks."""
        todo = list(pieces)
        while todo:
            first = todo[0]
            freed = 0
            if first.seq.ring and self.pool.free() < len(first.tokens):
                freed = self._overwrite_oldest(first.seq, len(first.tokens) - self.pool.free())
            start, length = self.pool.free_run(sum(len(p.tokens) for p in todo))
            if length == 0:
                raise RuntimeError("no free cell although every request's cells were reserved")
            call = []
            while todo and length > 0:
                p = todo[0]
                if len(p.tokens) <= length:
                    call.append(todo.pop(0))
                    length -= len(p.tokens)
                else:  # the rest of this prompt piece goes to the next call
                    head, todo[0] = p.split(length)
                    call.append(head)
                    length = 0
            yield Call.of(start, self.past(), call, freed)

    def _overwrite_oldest(self, seq: PoolSequence, count: int) -> int:
        """Free a ring's `count` oldest cells after its sinks: those tokens leave the context now,
        before the call that overwrites them (which cells they are does not matter: what a token
        sees is set by the mask, so a ring behaves the same in any layout of its cells)."""
        if seq.sinks + count > seq.n:
            raise EdgeKVError("ring cache: no cell left to overwrite beside the sinks")
        self.pool.drop(seq._drop_oldest(count))
        return count

    def commit(self, call: Call) -> None:
        """A call wrote its tokens' K/V at [write, write + size): the sequences hold them (a
        windowed pool: the kept local K/V in their rings too)."""
        self.pool.take(np.arange(call.write, call.write + call.size))
        w = call.write
        for p in call.pieces:
            self.window_rings.mark(p)
            p.seq._extend(range(w, w + len(p.tokens)), p.tokens)
            w += len(p.tokens)

    def protect(self, call: Call) -> None:
        """Before a call writes its cells: an open turn copies those it may have to restore."""
        self.turns.protect(call.write, call.size)

    # -- compaction
    def tidy(self, want: int) -> None:
        """Compact the pool before a step when the past, now or once the step's `want` new cells
        are written where they would land, runs beyond what the sequences' cells need (rounded
        to the bucket), or when those cells would not lie in one free run (several calls, each
        reading all the weights). Not for chat (kept sequences, turns: a rollback restores
        owners, not moved cells): one conversation's pool fragments only where its ring overwrites."""
        if self.turns.open or self.kept:
            return
        pool = self.pool
        start, length = pool.free_run(want)
        reach = max(pool.live_high_water(), start + length)
        if self.bucket(reach) > self.bucket(int(pool.live().sum()) + want) or length < min(want, pool.free()):
            self.compact()

    def compact(self) -> None:
        """Move cells to the pool's compaction layout (their K/V rows copied) and rename every
        owner's cells: the pool's and the sequences'."""
        assert not self.turns.open and not self.kept, "compaction would leave a turn or a kept sequence stale"
        perm, moved = self.pool.compaction()
        if not moved.size:
            return
        t0 = time.perf_counter()
        try:
            self.cache.move_cells(moved, perm[moved])
        except BaseException:  # rows half moved: no cached prefix can be trusted (the step fails its requests)
            while self.evict_one():
                pass
            raise
        self.pool.relabel(perm)
        for seq in self.sequences:
            seq._relabel(perm)
        self.counters.moved_cells += int(moved.size)
        self.counters.compaction_seconds += time.perf_counter() - t0
