"""Window rings: where a windowed pool (cache.local_ring: chat's, docs/models.md) keeps its local
layers' K/V. Its cells hold the global layers' only; each running sequence has a ring of
`local_ring` slots of its own for the local layers, from `take` to `give_back`. Position p sits
in slot p mod local_ring (PoolSequence.window_positions says which position each slot holds). Not
to be confused with the StreamingLLM ring (PoolSequence.ring): that one is of cells, and drops a
sequence's oldest tokens.

A call's kept local K/V land in the rings (`writes`: each piece's last local_ring tokens), and
`mark` records them in the sequences; a truncation keeps the ring only while it still holds the
window before the new end (`holds_window`); a snapshot carries the ring's rows in position order
(`RING` keys) and a restore puts them back, or takes them from the cells of a snapshot of a
cache that keeps every position. The KV manager (kv.py) calls these where a sequence's cells
change; a pool without local rings has NoWindowRings, which keep nothing."""
from __future__ import annotations

import numpy as np

from edgekv.errors import EdgeKVError
from edgekv.runtime.batching.plan import Call, Piece
from edgekv.runtime.batching.poolseq import PoolSequence
from edgekv.runtime.cache import KVCache

RING = "ring."  # a windowed pool's snapshot: "ring." + a local buffer's name, and RING_POSITIONS
RING_POSITIONS = RING + "positions"


def split_window(snap: dict) -> tuple[dict, dict]:
    """(a snapshot's cells, its ring part: the RING keys without their prefix)."""
    cells = {k: v for k, v in snap.items() if not k.startswith(RING)}
    return cells, {k[len(RING):]: v for k, v in snap.items() if k.startswith(RING)}


class WindowRings:
    def __init__(self, cache: KVCache):
        self.cache, self.length = cache, cache.local_ring
        self.free = list(range(cache.rings))  # rings not given to a sequence

    def take(self, seq: PoolSequence) -> None:
        if not self.free:
            raise EdgeKVError(f"every one of the {self.cache.rings} rings of the local layers' window is in use")
        seq._take_window_ring(self.free.pop(0), self.length)

    def give_back(self, seq: PoolSequence) -> None:
        self.free.append(seq.window_ring)

    def forget_from(self, seq: PoolSequence, n: int) -> None:
        """Its ring's slots holding position n or later hold nothing (0: the whole ring)."""
        seq._forget_window_from(n)

    def holds_window(self, seq: PoolSequence, n: int) -> bool:
        """Its ring holds every position of the window before n."""
        need = np.arange(max(0, n - (self.cache.window or 1) + 1), n)
        return bool(np.isin(need, seq.window_positions()).all())

    # -- a call
    def kept(self, p: Piece) -> tuple[int, np.ndarray]:
        """Of a piece's tokens, the first whose local K/V its ring keeps, and the positions kept:
        its last local_ring tokens'."""
        first = max(0, len(p.tokens) - self.length)
        return first, p.seq.pos + np.arange(first, len(p.tokens))

    def writes(self, call: Call) -> tuple[np.ndarray, np.ndarray]:
        """(the call's token rows whose local K/V are kept, their ring slots): the step runner's."""
        rows, slots, r = [], [], 0
        for p in call.pieces:
            first, kept = self.kept(p)
            rows.append(r + np.arange(first, len(p.tokens)))
            slots.append(p.seq.window_ring * self.length + kept % self.length)
            r += len(p.tokens)
        return np.concatenate(rows), np.concatenate(slots)

    def mark(self, p: Piece) -> None:
        """A call wrote piece p's kept local K/V (before p's tokens join its sequence)."""
        p.seq._mark_window(self.kept(p)[1])

    # -- snapshots
    def filled(self, seq: PoolSequence) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Its ring's filled slots in position order: (their positions [n], local buffer name -> rows
        [n, 1, Hkv, D]), host copies (a snapshot's ring part, a prefix entry's window copy)."""
        pos = seq.window_positions()
        slots = np.flatnonzero(pos >= 0)
        slots = slots[np.argsort(pos[slots])]
        return pos[slots], {name: v[slots] for name, v in self.cache.read_ring(seq.window_ring).items()}

    def snapshot(self, seq: PoolSequence) -> dict[str, np.ndarray]:
        """The RING part of a snapshot: `filled`'s rows and positions."""
        pos, rows = self.filled(seq)
        return {RING + name: v for name, v in rows.items()} | {RING_POSITIONS: pos}

    def to_restore(self, seq: PoolSequence, cells: dict, ring: dict, ids: list[int], n: int) -> tuple:
        """The (positions, rows) a restored sequence's ring gets, checked before anything is
        written: the snapshot's ring part, or from a full cache's snapshot the last local_ring
        cells of the local layers."""
        local = self.cache.local_names
        if not ring:  # a snapshot of the full cache: its cells, in position order, hold every local row
            if not set(local) <= set(cells):
                raise EdgeKVError("snapshot does not match this cache's layout")
            gone = len(ids) - n  # a wrapped ring's cells after its sinks hold the last positions
            sinks = seq.sinks or 0
            pos = np.r_[np.arange(min(sinks, n)), np.arange(min(sinks, n), n) + gone].astype(np.int64)
            keep = np.flatnonzero(pos >= len(ids) - self.length)
            return pos[keep], {name: cells[name][keep] for name in local}
        pos = np.asarray(ring.get("positions", np.zeros(0)), np.int64)
        if set(ring) != set(local) | {"positions"} or pos.ndim != 1 \
                or len(set(pos.tolist())) != len(pos) or (len(pos) and not 0 <= pos.min() <= pos.max() < len(ids)) \
                or any(ring[k].shape != (len(pos), *self.cache.shapes[k][1:]) or ring[k].dtype != self.cache.dtypes[k]
                       for k in local):
            raise EdgeKVError("snapshot does not match this cache's layout")
        keep = np.argsort(pos)[-self.length:]  # (a longer ring's save: its last positions)
        return pos[keep], {k: ring[k][keep] for k in local}

    def put(self, seq: PoolSequence, pos: np.ndarray, rows: dict) -> None:
        """Its ring holds exactly these positions' rows."""
        slots = pos % self.length
        order = np.argsort(slots)  # write_local copies runs of consecutive slots
        for name in self.cache.local_names:
            self.cache.write_local(name, seq.window_ring * self.length + slots[order], rows[name][order])
        seq._place_window(pos)


class NoWindowRings:
    """A pool whose cells hold every layer's K/V: no ring to keep."""

    def take(self, seq: PoolSequence) -> None:
        pass

    give_back = take

    def forget_from(self, seq: PoolSequence, n: int) -> None:
        pass

    def holds_window(self, seq: PoolSequence, n: int) -> bool:
        return True

    def mark(self, p: Piece) -> None:
        pass

    def snapshot(self, seq: PoolSequence) -> dict:
        return {}

    def to_restore(self, seq: PoolSequence, cells: dict, ring: dict, ids: list[int], n: int) -> None:
        if ring:
            raise EdgeKVError("a snapshot of a windowed cache (its local layers keep only their window) "
                              "does not load into a cache that keeps every position")
        return None
