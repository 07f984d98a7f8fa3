"""PoolSequence: one sequence's cells in the shared pool, for serve (one per request, released at
its end) and chat (one held across turns) alike. Its cells, ids and window ring are written by
the KV manager only, through the methods marked so (kv.py; its window rings, window_rings.py, and
turns, turns.py, are its parts); its owner chooses the ring (`enable_ring` / `disable_ring`, on
an empty sequence); everyone else reads it.

`cells` are the cells of the tokens in context, in position order; `ids` every token fed since
the last reset (a ring's overwritten ones too), so the next position is len(ids). A ring
(StreamingLLM) keeps its first `sinks` cells forever and overwrites the oldest of the rest.

In a windowed pool (docs/models.md) it also has a window ring of the local layers' slots
(`window_ring`: which one, `window_positions`: the position each of its slots holds, -1 none;
batching/window_rings.py), written by the KV manager: position p sits in slot p mod the ring's
length. (`ring` is the StreamingLLM ring of its cells, another thing.)"""
from __future__ import annotations

import numpy as np

from edgekv.errors import ContextOverflow, EdgeKVError

NO_LIMIT = 1 << 62


class PoolSequence:
    def __init__(self, capacity: int, max_positions: int):
        self.capacity = capacity  # cells it may hold: the pool's (and at most the verified positions)
        self.max_positions = max_positions  # positions the bundle was verified for
        self._cells: list[int] = []
        self._ids: list[int] = []
        self._sinks: int | None = None
        self._window_ring: int | None = None  # its window ring of the local layers' slots (a windowed pool)
        self._window_pos: np.ndarray | None = None  # [cache.local_ring] the position each slot holds, -1 none

    # -- what it holds (read-only)
    @property
    def n(self) -> int:
        return len(self._cells)

    @property
    def pos(self) -> int:
        return len(self._ids)

    @property
    def cells(self) -> list[int]:
        return list(self._cells)

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    def cell_view(self) -> list[int]:
        """Its cells without a copy, for the step runner's mask (read, never changed)."""
        return self._cells

    def cell_positions(self) -> np.ndarray:
        """[n] the RoPE position each of its cells holds, in cell order: cell k holds position k,
        except in a wrapped ring, whose cells after the sinks hold the last positions fed."""
        n, gone = len(self._cells), len(self._ids) - len(self._cells)
        out = np.arange(n, dtype=np.int64)
        out[self._sinks or 0:] += gone
        return out

    @property
    def window_ring(self) -> int | None:
        return self._window_ring

    def window_positions(self) -> np.ndarray | None:
        """[cache.local_ring] the position each of its window ring's slots holds (-1: none); read, never changed."""
        return self._window_pos

    @property
    def sinks(self) -> int | None:
        return self._sinks

    @property
    def ring(self) -> bool:
        return self._sinks is not None

    @property
    def wrapped(self) -> bool:
        """A ring that has overwritten tokens (its cells no longer hold every id)."""
        return len(self._ids) > len(self._cells)

    def room(self) -> int:
        """Tokens it may still be fed: free cells (a ring always has some) and verified positions."""
        cells = NO_LIMIT if self.ring else self.capacity - self.n
        return min(cells, self.max_positions - self.pos)

    def can_feed(self) -> bool:
        """One more token fits: a cell (a ring overwrites) and a verified position."""
        return self.pos < self.max_positions and (self.ring or self.n < self.capacity)

    def recent(self, k: int) -> list[int]:
        """The last k token ids fed (the sampler's repetition window)."""
        return self._ids[-k:] if k > 0 else []

    # -- the owner's choice, on an empty sequence
    def enable_ring(self, sinks: int) -> None:
        """Make this (empty) sequence a ring that keeps its first `sinks` cells."""
        if self.n:
            raise ValueError("a ring is set up on an empty sequence")
        self.check_sinks(sinks)
        self._sinks = sinks

    def check_sinks(self, sinks: int) -> None:
        """`enable_ring(sinks)` would accept them (an error saying why not)."""
        if not 0 <= sinks < self.capacity - 1:
            raise EdgeKVError(f"ring cache: {sinks} sink cells leave no ring in a capacity of {self.capacity}")

    def disable_ring(self) -> None:
        if self.ring and self.n:
            raise ValueError("a ring is set up on an empty sequence")
        self._sinks = None

    def check_restore(self, n: int, ids: list[int]) -> None:
        """`Batcher.restore` would accept n cells holding the last n of `ids` (an error saying why not)."""
        if n > self.capacity:
            raise ContextOverflow(f"snapshot holds {n} tokens, more than the cache capacity {self.capacity}",
                                  setting="capacity", fix="raise {}")
        if len(ids) > n and not self.ring:
            raise EdgeKVError("saved from a ring cache that has wrapped", setting="context_policy",
                              fix="load it with {} ring")
        if len(ids) < n:
            raise EdgeKVError(f"snapshot holds {n} cells but {len(ids)} token ids")
        if len(ids) > self.max_positions:
            raise ContextOverflow(f"snapshot holds {len(ids)} positions, more than the {self.max_positions} "
                                  f"this bundle was verified for")

    # -- the KV manager's
    def _set(self, cells: list[int], ids: list[int]) -> None:
        self._cells, self._ids = list(cells), list(ids)

    def _extend(self, cells, ids) -> None:
        self._cells.extend(cells)
        self._ids.extend(ids)

    def _drop_oldest(self, count: int) -> list[int]:
        """A ring's `count` oldest cells after its sinks leave the context; returns them."""
        sinks = self._sinks
        gone = self._cells[sinks: sinks + count]
        del self._cells[sinks: sinks + count]
        return gone

    def _relabel(self, perm) -> None:
        self._cells = perm[self._cells].tolist() if self._cells else []

    def _take_window_ring(self, ring: int, length: int) -> None:
        """Ring `ring` of `length` slots is its own, empty."""
        self._window_ring, self._window_pos = ring, np.full(length, -1, np.int64)

    def _forget_window_from(self, position: int) -> None:
        """Its ring's slots holding `position` or later hold nothing (0: the whole ring)."""
        self._window_pos[self._window_pos >= position] = -1

    def _place_window(self, positions: np.ndarray) -> None:
        """Its ring holds exactly `positions`, each at its slot (position mod the ring's length)."""
        self._window_pos[:] = -1
        self._mark_window(positions)

    def _mark_window(self, positions: np.ndarray) -> None:
        """A call wrote `positions` into its ring (each at position mod the ring's length)."""
        self._window_pos[positions % len(self._window_pos)] = positions

    def _state(self) -> tuple:
        ring = None if self._window_pos is None else self._window_pos.copy()
        return list(self._cells), list(self._ids), self._sinks, ring

    def _restore_state(self, state: tuple) -> None:
        cells, ids, self._sinks, ring = state
        self._cells, self._ids = list(cells), list(ids)
        if ring is not None:
            self._window_pos[:] = ring
