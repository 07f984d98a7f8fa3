"""Prefix windows: what a windowed pool's prefix cache (serve) keeps beside each entry's cells.

In a windowed pool (docs/models.md) a sequence's cells hold the global layers' K/V only; its
local layers' K/V are in its own ring, which it gives back when it ends. So an entry of the
prefix cache (pool.py: token ids -> cells) is usable only with the local layers' window before
the end of the match, and the ring that wrote it has moved on by the time the request ends. The
KV manager therefore copies the ring's filled slots (host copies, in position order) at the moment
an entry is made: when a prompt is wholly in cells (the ring holds the window before the prompt's
end) and when a request ends (the window before its end). A later match of length k is reused
only where its entry's copy holds every position of [k - W + 1, k): a match of the whole entry,
or one ending up to the ring's margin before it (a repeated prompt stops one short: its last
token is always fed). A shorter match (a shared system prompt before different questions)
finds no window and is prefilled. The copies cost host memory, counted in `nbytes`."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from edgekv.runtime.cache import KVCache
from edgekv.runtime.pool import Prefix


class Window(NamedTuple):
    positions: np.ndarray  # [n] ascending
    rows: dict  # local buffer name -> [n, 1, Hkv, D] rows of those positions

    def holds(self, start: int, stop: int) -> bool:
        """Every position of [start, stop) is in the copy."""
        return bool(np.isin(np.arange(start, stop), self.positions).all())

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.rows.values())


class PrefixWindows:
    def __init__(self, cache: KVCache):
        self.cache = cache
        self.saved: dict[Prefix, Window] = {}
        self.nbytes = 0  # the copies' host bytes (a gauge read by /health and /metrics)

    def keep(self, key: Prefix, positions: np.ndarray, rows: dict) -> None:
        """Keep for entry `key` the copy of its ring's filled slots (WindowRings.filled)."""
        self._drop(key)
        self.saved[key] = Window(positions, rows)
        self.nbytes += self.saved[key].nbytes

    def serves(self, key: Prefix, k: int) -> bool:
        """Entry `key`'s copy holds the window before a match of its first k tokens."""
        w = self.saved.get(key)
        return w is not None and w.holds(max(0, k - self.cache.window + 1), k)

    def before(self, key: Prefix, k: int) -> Window:
        """The copy's positions before k (those after it are the entry's, not the match's)."""
        w = self.saved[key]
        keep = w.positions < k
        return Window(w.positions[keep], {name: v[keep] for name, v in w.rows.items()})

    def follow(self, entries) -> None:
        """Forget the copies of entries the pool no longer has (evicted or replaced)."""
        for key in [k for k in self.saved if k not in entries]:
            self._drop(key)

    def _drop(self, key: Prefix) -> None:
        w = self.saved.pop(key, None)
        if w is not None:
            self.nbytes -= w.nbytes
