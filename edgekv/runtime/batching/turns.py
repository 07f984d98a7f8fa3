"""Turns: what a turn changes can be undone exactly (an interrupted or failed chat turn). `begin`
remembers who holds which cell and what the kept sequences hold; before each call writes cells,
`protect` copies those in use at the turn's start (once each: where the memory reads row ranges,
else the whole cache once); `rollback` puts all of it back."""
from __future__ import annotations

import numpy as np

from edgekv.errors import EdgeKVError
from edgekv.runtime.cache import KVCache
from edgekv.runtime.memory import runs
from edgekv.runtime.pool import CellPool


class Turn:
    """What a rollback restores: the pool's owners, the kept sequences, and the rows of cells
    written since (copied before their first write)."""

    def __init__(self, pool: tuple, kept: list, capacity: int, undo=None):
        self.pool, self.kept, self.undo = pool, kept, undo  # undo: the caller's own part (Batcher.turn)
        self.rows: list[tuple[int, dict]] = []
        self.whole: dict | None = None  # the whole cache, where the memory cannot copy row ranges
        self.saved = np.zeros(capacity, np.bool_)
        self.window_rings: list[tuple[int, dict]] = []  # a windowed pool: the kept sequences' rings, copied whole
        self.committed = False  # what it changed is kept (set as the turn closes)
        self.undoing = False  # its rollback began (a turn left open so was cut short)


class Turns:
    def __init__(self, cache: KVCache, pool: CellPool):
        self.cache, self.pool = cache, pool
        self.current: Turn | None = None

    @property
    def open(self) -> bool:
        return self.current is not None

    def begin(self, kept: list, undo=None) -> Turn:
        turn = Turn(self.pool.state(), [(s, s._state()) for s in kept], self.cache.capacity, undo)
        # a ring is small (the window) and any call may write any of its slots: copied at the start
        turn.window_rings = [(s.window_ring, self.cache.read_ring(s.window_ring)) for s in kept
                             if s.window_ring is not None]
        self.current = turn  # open only once whole
        return turn

    def commit(self) -> None:
        """Keep what the open turn changed; one line, so an interrupt finds it open or committed."""
        if self.current is not None:
            self.current.committed, self.current = True, None

    def mark_undoing(self) -> None:
        """The open turn's rollback has begun: a turn left open from here on was cut short, and the
        next turn finishes it instead of joining it (Batcher.turn)."""
        if self.current is not None:
            self.current.undoing = True

    def rollback(self) -> bool:
        """Back to `begin`: the cells' owners, the kept sequences and every overwritten cell as
        they were. False when no turn was open. The turn closes only once all of it is back: a
        rollback cut short (a second Ctrl-C) is done again whole by the next call."""
        turn = self.current
        if turn is None:
            return False
        self.mark_undoing()
        if turn.undo is not None:  # the caller's fields first: they go back with the cells, never after them
            turn.undo()
        if turn.whole is not None:
            self.cache.write(turn.whole)
        for start, rows in turn.rows:
            self.cache.write_rows(start, rows)
        for ring, rows in turn.window_rings:
            self.cache.write_ring(ring, rows)
        self.pool.set_state(turn.pool)
        for seq, state in turn.kept:
            seq._restore_state(state)
        self.current = None
        return True

    def protect(self, w: int, s: int) -> None:
        """Before a call writes cells [w, w + s): copy those in use at the turn's start, once each."""
        turn = self.current
        if turn is None or turn.whole is not None:
            return
        todo = (turn.pool.refs[w: w + s] > 0) & ~turn.saved[w: w + s]
        if not todo.any():
            return
        if not self.cache.reads_rows:
            turn.whole = self.cache.read(self.cache.capacity)
            return
        for a, b in runs(w + np.flatnonzero(todo)):
            turn.rows.append((a, self.cache.read_rows(a, b)))
        turn.saved[w: w + s] |= todo


class NoTurns:
    """Chat's turns need the cell pool (a kept sequence, its rollback): never open here."""
    open = False
    current = None

    def begin(self, kept):
        raise EdgeKVError("a chat turn runs on the cell pool, not on fused slots")

    def commit(self) -> None:
        pass

    def rollback(self) -> bool:
        return False
