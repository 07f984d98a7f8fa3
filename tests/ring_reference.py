"""A REFERENCE IMPLEMENTATION FOR TESTS ONLY: a single stream whose own cache is a ring
(StreamingLLM), as edgekv's Sequence was before the ring became the batcher's alone (issue 25).
Product code runs one ring, chat's (edgekv/runtime/batching/poolseq.py, the pool's cells); this
one is its oracle (tests/test_chat_engine.py: the same tokens, token by token) and the ring side
of tests/test_runtime.py. Use it through RingGenerator(backend, cache, RingSequence(...)): product
code's single stream always appends (Backend.run writes after the filled slots), so the ring's
calls go through the pool's entry point instead, run_cells, which takes the write slot and the
mask whole (`run_ring`).

It writes slots in order, keeps slots [0, sinks) and overwrites the oldest of [sinks, capacity)
once full; positions keep growing, so the filled slots are no longer in order ("wrapped").

What it shares and what it keeps to itself: the bookkeeping a ring has in common with a linear
stream (the fed ids, positions, the filled past's key mask, reset, truncate, the linear restore)
is edgekv's Sequence (subclassed), and the owner's ring set-up rule (an empty sequence, sinks
that leave a ring) is the pool sequence's (called). The ring rule itself is written here again,
on slots, in the old way: where the next write lands (w, back to the sinks at the end), which
keys a call evicts (the slots it overwrites), and what a wrapped snapshot must look like. Those
are what the chat ring's tests compare against (kv.py drops the oldest cells of a list; the step
runner masks by cells), so sharing them would make the oracle check the code with itself."""
from __future__ import annotations

import numpy as np

from edgekv.errors import ContextOverflow, EdgeKVError, NonFinite
from edgekv.runtime.batching.poolseq import PoolSequence
from tests.stream_reference import Generator
from tests.stream_reference import Sequence


class RingSequence(Sequence):
    def __init__(self, capacity: int, max_positions: int):
        super().__init__(capacity, max_positions)
        self._w = 0  # write slot: the next call's new tokens go to [w, w + S) (== n unless a ring wrapped)
        self._sinks: int | None = None  # ring: the first `sinks` slots are kept forever, the rest wrap

    # the owner's ring set-up, on an empty sequence: the pool sequence's rule
    sinks = PoolSequence.sinks
    ring = PoolSequence.ring
    enable_ring = PoolSequence.enable_ring
    check_sinks = PoolSequence.check_sinks
    disable_ring = PoolSequence.disable_ring

    # -- what it holds (read-only)
    @property
    def w(self) -> int:
        return self._w

    @property
    def wrapped(self) -> bool:
        return self.ring and self._n == self.capacity and self._w < self._n

    # -- what the next call may do
    def room(self) -> int:
        """Tokens that may still be fed: a ring always has slots (it overwrites); positions left."""
        return self.max_positions - self._pos if self.ring else super().room()

    def max_write(self) -> int:
        """The most tokens one call may write: up to the end of the slots (a ring call never
        wraps in the middle; the next one starts again after the sinks)."""
        return self.capacity - self._w

    def check_room(self, s: int) -> None:
        """s more tokens fit (a ring: positions permitting)."""
        if not self.ring:
            return super().check_room(s)
        if s > self.max_positions - self._pos:
            raise ContextOverflow(f"positions full: {self._pos} + {s} tokens exceed the {self.max_positions} "
                                  f"positions this bundle was verified for")

    def check_write(self, s: int) -> None:
        """One graph call may write s tokens at the write slot (a ring's call may not wrap)."""
        self.check_room(s)
        if s > self.max_write():
            raise ContextOverflow(f"ring cache: a call of {s} tokens would wrap; at most {self.max_write()} now")

    def key_mask(self, s: int, past: int | None = None) -> np.ndarray:
        """Sequence's mask of the filled past and the new block, less the slots this call
        overwrites: their old keys leave the context now."""
        m = super().key_mask(s, past)
        if self.ring and self._w < self._n:
            m[0, :, self._w: self._w + s] = False
        return m

    def local_key_mask(self, s: int, past: int | None = None) -> None:
        """No local layers on a ring (its slots are not in position order): the tests' models have none."""
        if getattr(self, "window", None) is not None:
            raise NotImplementedError("the reference ring has no sliding-window layers")
        return None

    # -- changes
    def advance(self, ids) -> None:
        """A call wrote the K/V of `ids` at the write slot; at the end of the slots a ring's next
        write goes back to the first slot after its sinks."""
        s = len(ids)
        self._ids.extend(int(t) for t in ids)
        self._pos += s
        self._w += s
        self._n = max(self._n, self._w)
        if self.ring and self._w == self.capacity:
            self._w = self._sinks

    def reset(self, pos: int = 0) -> None:
        super().reset(pos)
        self._w = 0

    def truncate(self, n: int) -> None:
        """Forget everything after the first n slots (undo / regenerate); not once wrapped."""
        if self.wrapped:
            raise ValueError(f"cannot truncate a sequence of {self._n} tokens to {n} (the ring has wrapped)")
        super().truncate(n)
        self._w = n

    def check_restore(self, n: int, ids: list[int], w: int | None = None) -> None:
        """`restore` would accept this saved state (an error saying why not; nothing changes)."""
        if w is None or w == n:
            return super().check_restore(n, ids)
        # a ring that had wrapped: the next write goes to its old slot
        if n > self.capacity:
            raise ContextOverflow(f"snapshot holds {n} tokens, more than the cache capacity {self.capacity}",
                                  setting="capacity", fix="raise {}")
        if not self.ring or not self._sinks <= w < n == self.capacity:
            raise EdgeKVError("snapshot of a wrapped ring does not fit this cache")
        if len(ids) < n:
            raise EdgeKVError("snapshot holds more slots than token ids")
        if len(ids) > self.max_positions:
            raise ContextOverflow(f"snapshot holds {len(ids)} positions, more than the {self.max_positions} "
                                  f"this bundle was verified for")

    def restore(self, n: int, ids: list[int], w: int | None = None) -> None:
        """Take the state of a saved sequence whose first n slots were just restored: the token
        ids it had been fed (from position 0) and, for a ring that had wrapped, its write slot."""
        self.check_restore(n, ids, w)
        self._n = n
        self._w = n if w is None else w
        self._ids = [int(t) for t in ids]
        self._pos = len(self._ids)  # positions run with the conversation, also past a ring's wrap


def run_ring(backend, cache, seq: RingSequence, ids: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
    """One call of the ring's s tokens at its write slot w: the filled past [0, n) bound whole,
    the slots the call overwrites masked (seq.key_mask), through the backend's run_cells."""
    s = ids.shape[1]
    local = seq.local_key_mask(s, seq.n)
    return backend.run_cells(cache, seq.n, seq.w, ids, seq.positions(s), seq.key_mask(s, seq.n), logits_index,
                             *([local] if local is not None else []))


class RingGenerator(Generator):
    """Generator over a RingSequence: each call at the ring's write slot (run_ring), checked not
    to wrap; a wrapped ring restores with its write slot."""

    def _call(self, ids: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        self.seq.check_write(ids.shape[1])
        logits = run_ring(self.backend, self.cache, self.seq, ids, logits_index)
        if not np.isfinite(logits).all():
            raise NonFinite()
        self.seq.advance(ids[0])
        return logits

    def restore(self, snap: dict[str, np.ndarray], ids: list[int], w: int | None = None) -> None:
        n = self.cache.slots_in(snap)
        self.seq.check_restore(n, ids, w)  # both checked before either changes
        self.cache.write(snap)
        self.seq.restore(n, ids, w)
