"""CellPool: which cells of one shared KVCache hold what, for several sequences at once.

The server's KV memory is one KVCache allocated once; its slots are *cells*. A cell may belong to
several sequences (a shared prefix: the K/V of a token depend only on the tokens before it), so
each cell has a reference count; a cell with none is free. The prefix cache keeps the cells of
prompts already computed (token ids -> cells) so a later request starting with the same tokens
takes those cells instead of prefilling them again; its entries are dropped, least recently
used first, when the cells are needed. See docs/serve.md."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np


class CellPool:
    def __init__(self, capacity: int, max_prefixes: int = 32):
        self.capacity = capacity
        self.refs = np.zeros(capacity, np.int32)
        self.max_prefixes = max_prefixes
        self.prefixes: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()  # LRU first

    # -- counts
    def used(self) -> int:
        return int(np.count_nonzero(self.refs))

    def free(self) -> int:
        return self.capacity - self.used()

    def high_water(self) -> int:
        """One past the highest cell in use: the past a call binds is cells [0, high_water)."""
        nz = np.flatnonzero(self.refs)
        return int(nz[-1]) + 1 if nz.size else 0

    def cached_only(self) -> int:
        """Cells held by nothing but the prefix cache (freed by evicting it)."""
        held = self._cache_holds()
        return int(np.count_nonzero((held > 0) & (held == self.refs)))

    def run_without_cache(self, want: int) -> int:
        """The free run free_run(want) would find if the whole prefix cache were evicted."""
        return self.free_run(want, self.refs - self._cache_holds())[1]

    def _cache_holds(self) -> np.ndarray:
        held = np.zeros(self.capacity, np.int32)
        for cells in self.prefixes.values():
            held[cells] += 1
        return held

    # -- ownership
    def state(self) -> tuple:
        """A copy of who holds what (reference counts, prefix cache), for `set_state`."""
        return self.refs.copy(), OrderedDict(self.prefixes)

    def set_state(self, state: tuple) -> None:
        refs, prefixes = state
        self.refs[:] = refs
        self.prefixes = OrderedDict(prefixes)

    def take(self, cells) -> None:
        np.add.at(self.refs, np.asarray(cells, np.int64), 1)

    def drop(self, cells) -> None:
        np.add.at(self.refs, np.asarray(cells, np.int64), -1)
        assert self.refs.min() >= 0, "a cell was dropped more often than taken"

    def free_run(self, want: int, refs: np.ndarray | None = None) -> tuple[int, int]:
        """(start, length) of the lowest run of free cells at least `want` long (low cells keep
        the bound past short), else the longest run; length 0 when the pool is full. `refs`:
        other reference counts to read instead of the pool's own."""
        free = np.concatenate([[False], (self.refs if refs is None else refs) == 0, [False]])
        edges = np.flatnonzero(free[1:] != free[:-1])
        starts, ends = edges[::2], edges[1::2]
        if starts.size == 0:
            return 0, 0
        lengths = ends - starts
        fit = np.flatnonzero(lengths >= want)
        i = int(fit[0]) if fit.size else int(np.argmax(lengths))
        return int(starts[i]), int(min(lengths[i], want))

    # -- prefix cache
    def lookup(self, ids: list[int]) -> tuple[int, np.ndarray]:
        """The longest cached prefix of `ids`: (its length, its cells). The entry becomes the
        most recently used."""
        best, best_key = 0, None
        arr = np.asarray(ids, np.int64)
        for key in self.prefixes:
            n = min(len(key), len(arr))
            if n <= best:
                continue
            same = np.asarray(key[:n], np.int64) == arr[:n]
            k = n if same.all() else int(np.argmin(same))
            if k > best:
                best, best_key = k, key
        if best_key is None:
            return 0, np.zeros(0, np.int64)
        self.prefixes.move_to_end(best_key)
        return best, self.prefixes[best_key][:best]

    def remember(self, ids: list[int], cells: np.ndarray) -> None:
        """Cache the cells of `ids` (a computed prompt); an entry it extends is replaced."""
        key = tuple(int(t) for t in ids)
        if not key:
            return
        for old in [k for k in self.prefixes if len(k) <= len(key) and key[: len(k)] == k]:
            self.drop(self.prefixes.pop(old))
        if any(len(k) > len(key) and k[: len(key)] == key for k in self.prefixes):
            return  # a longer entry already holds these cells
        cells = np.asarray(cells, np.int64).copy()
        self.take(cells)
        self.prefixes[key] = cells
        while len(self.prefixes) > self.max_prefixes:
            self.evict_one()

    def evict_one(self) -> bool:
        """Drop the least recently used prefix; False when there is none."""
        if not self.prefixes:
            return False
        _, cells = self.prefixes.popitem(last=False)
        self.drop(cells)
        return True
