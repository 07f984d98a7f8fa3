"""CellPool: which cells of one shared KVCache hold what, for several sequences at once.

The server's KV memory is one KVCache allocated once; its slots are *cells*. A cell may belong to
several sequences (a shared prefix: the K/V of a token depend only on the tokens before it), so
each cell has a reference count; a cell with none is free. The prefix cache keeps the cells of
prompts already computed (token ids -> cells) so a later request starting with the same tokens
takes those cells instead of prefilling them again; its entries are dropped, least recently
used first, when the cells are needed. The engine keeps the layout tidy with `compaction`: the
sequences' cells first (they are the past every call binds), then the free run, then the cells
only the prefix cache holds (above the bound past: no call's cost grows with the cache). See
docs/serve.md."""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import numpy as np


class Prefix(tuple):
    """A prefix-cache key: the token ids (the tuple) and the tenant whose prompt they were (one
    API key's clients; "" for all when there is one). Equal only to a key of the same tenant."""

    def __new__(cls, ids, tenant: str = ""):
        key = super().__new__(cls, (int(t) for t in ids))
        key.tenant = tenant
        return key

    def __eq__(self, other):
        return isinstance(other, Prefix) and self.tenant == other.tenant and tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash((self.tenant, tuple(self)))


class PoolState(NamedTuple):
    """A copy of who holds what (`CellPool.state`)."""
    refs: np.ndarray
    cache_refs: np.ndarray
    prefixes: OrderedDict


class CellPool:
    def __init__(self, capacity: int, max_prefixes: int = 32):
        self.capacity = capacity
        self.refs = np.zeros(capacity, np.int32)  # every owner: sequences and prefix-cache entries
        self.cache_refs = np.zeros(capacity, np.int32)  # of which prefix-cache entries
        self.max_prefixes = max_prefixes
        self.prefixes: OrderedDict[Prefix, np.ndarray] = OrderedDict()  # LRU first

    # -- counts
    def used(self) -> int:
        return int(np.count_nonzero(self.refs))

    def free(self) -> int:
        return self.capacity - self.used()

    def live(self) -> np.ndarray:
        """Cells a sequence holds (not only the prefix cache), as a mask."""
        return self.refs > self.cache_refs

    def live_high_water(self) -> int:
        """One past the highest cell a sequence holds: a call binds the past [0, this)."""
        nz = np.flatnonzero(self.live())
        return int(nz[-1]) + 1 if nz.size else 0

    def cached_only(self) -> int:
        """Cells held by nothing but the prefix cache (freed by evicting it)."""
        return int(np.count_nonzero((self.cache_refs > 0) & ~self.live()))

    # -- ownership
    def state(self) -> PoolState:
        """A copy of who holds what (reference counts, prefix cache), for `set_state`."""
        return PoolState(self.refs.copy(), self.cache_refs.copy(), OrderedDict(self.prefixes))

    def set_state(self, state: PoolState) -> None:
        self.refs[:], self.cache_refs[:] = state.refs, state.cache_refs
        self.prefixes = OrderedDict(state.prefixes)

    def take(self, cells) -> None:
        np.add.at(self.refs, np.asarray(cells, np.int64), 1)

    def drop(self, cells) -> None:
        np.add.at(self.refs, np.asarray(cells, np.int64), -1)
        assert self.refs.min() >= 0, "a cell was dropped more often than taken"

    def free_run(self, want: int) -> tuple[int, int]:
        """(start, length) of the lowest run of free cells at least `want` long (low cells keep
        the bound past short), else the longest run; length 0 when the pool is full."""
        free = np.concatenate([[False], self.refs == 0, [False]])
        edges = np.flatnonzero(free[1:] != free[:-1])
        starts, ends = edges[::2], edges[1::2]
        if starts.size == 0:
            return 0, 0
        lengths = ends - starts
        fit = np.flatnonzero(lengths >= want)
        i = int(fit[0]) if fit.size else int(np.argmax(lengths))
        return int(starts[i]), int(min(lengths[i], want))

    # -- prefix cache
    def lookup(self, ids: list[int], tenant: str = "", usable=None) -> tuple[int, np.ndarray]:
        """The longest prefix of `ids` cached by `tenant`: (its length, its cells). The entry
        becomes the most recently used. Another tenant's entries are never matched: a reused
        prefix (faster, and reported as cached tokens) would tell a client another's prompt.
        `usable`: as `match`'s."""
        k, key = self.match(ids, tenant, usable)
        return (k, self.use(key, k)) if key is not None else (0, np.zeros(0, np.int64))

    def match(self, ids: list[int], tenant: str = "", usable=None) -> tuple[int, Prefix | None]:
        """(the length of the longest prefix of `ids` cached by `tenant`, the entry holding it;
        None: none). `usable(key, k)`: whether entry `key` may serve a match of its first k
        tokens (a windowed pool's: where it kept the local layers' window before k)."""
        best, best_key = 0, None
        arr = np.asarray(ids, np.int64)
        for key in self.prefixes:
            n = min(len(key), len(arr))
            if n <= best or key.tenant != tenant:
                continue
            same = np.asarray(key[:n], np.int64) == arr[:n]
            k = n if same.all() else int(np.argmin(same))
            if k > best and (usable is None or usable(key, k)):
                best, best_key = k, key
        return best, best_key

    def use(self, key: Prefix, k: int) -> np.ndarray:
        """The first k cells of entry `key`, which becomes the most recently used."""
        self.prefixes.move_to_end(key)
        return self.prefixes[key][:k]

    def remember(self, ids: list[int], cells: np.ndarray, tenant: str = "") -> None:
        """Cache the cells of `ids` (a computed prompt) for `tenant`; an entry of the same
        tenant it extends is replaced."""
        key = Prefix(ids, tenant)
        if not key:
            return
        mine = [k for k in self.prefixes if k.tenant == tenant]
        for old in [k for k in mine if len(k) <= len(key) and key[: len(k)] == tuple(k)]:
            self._forget(old)
        if any(len(k) > len(key) and k[: len(key)] == tuple(key) for k in mine):
            return  # a longer entry already holds these cells
        cells = np.asarray(cells, np.int64).copy()
        self.take(cells)
        np.add.at(self.cache_refs, cells, 1)
        self.prefixes[key] = cells
        while len(self.prefixes) > self.max_prefixes:
            self.evict_one()

    def evict_one(self) -> bool:
        """Drop the least recently used prefix; False when there is none."""
        if not self.prefixes:
            return False
        self._forget(next(iter(self.prefixes)))
        return True

    def evict_freeing(self) -> bool:
        """Drop the least recently used prefix whose eviction frees a cell (one no sequence and no
        other entry holds); False when there is none. An entry whose cells a running request
        holds stays: it frees nothing now, and it is what that request resumes from after a
        preemption."""
        for key, cells in self.prefixes.items():
            if (self.refs[cells] == 1).any():
                self._forget(key)
                return True
        return False

    def _forget(self, key: "Prefix") -> None:
        cells = self.prefixes.pop(key)
        np.add.at(self.cache_refs, cells, -1)
        self.drop(cells)

    # -- layout
    def compaction(self) -> tuple[np.ndarray, np.ndarray]:
        """(perm, moved): the permutation (cell i's contents go to cell perm[i]) that puts the
        sequences' cells in [0, n_live), the cells only the prefix cache holds at the top of the
        pool and the free cells in one run between, and the cells in use it moves (each a copy
        of its K/V rows) — as few as there can be."""
        cap = self.capacity
        perm = np.arange(cap)
        live = self.live()
        cached = (self.refs > 0) & ~live
        n_live, top = int(live.sum()), cap - int(cached.sum())
        # sequences' cells above n_live trade places with the cached or free cells below it
        up, down = np.flatnonzero(live[n_live:]) + n_live, np.flatnonzero(~live[:n_live])
        perm[up], perm[down] = down, up
        cached_now = np.empty_like(cached)  # where the cached cells are after those swaps
        cached_now[perm] = cached
        # then cached cells below the top region trade places with the free cells inside it
        low, high = np.flatnonzero(cached_now[n_live:top]) + n_live, np.flatnonzero(~cached_now[top:]) + top
        where = np.argsort(perm)  # cell now at position j came from where[j]
        perm[where[low]], perm[where[high]] = high, low
        return perm, np.flatnonzero((perm != np.arange(cap)) & (self.refs > 0))

    def relabel(self, perm: np.ndarray) -> None:
        """Follow a compaction: every owner's cells renamed (the engine moved their contents)."""
        for arr in (self.refs, self.cache_refs):
            arr[perm] = arr.copy()
        for key, cells in self.prefixes.items():
            self.prefixes[key] = perm[cells]
