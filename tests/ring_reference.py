"""A REFERENCE IMPLEMENTATION FOR TESTS ONLY: a single stream whose own cache is a ring
(StreamingLLM), as edgekv's Sequence was before the ring became the batcher's alone (issue 25).
Product code runs one ring, chat's (edgekv/runtime/batching/poolseq.py, the pool's cells); this
one is its oracle (tests/test_chat_engine.py: the same tokens, token by token) and the ring side
of tests/test_runtime.py. Use it through Generator(backend, cache, RingSequence(...)).

It writes slots in order, keeps slots [0, sinks) and overwrites the oldest of [sinks, capacity)
once full; positions keep growing, so the filled slots are no longer in order ("wrapped")."""
from __future__ import annotations

import numpy as np

from edgekv.errors import ContextOverflow, EdgeKVError

NO_LIMIT = 1 << 62


class _Fed:
    """The token ids fed since the last reset, a ring's sinks, and the size checks of a saved state."""

    def __init__(self, capacity: int, max_positions: int):
        self.capacity = capacity  # slots (cells) it may fill
        self.max_positions = max_positions  # positions the bundle was verified for
        self._ids: list[int] = []  # token ids fed since the last reset, in order
        self._sinks: int | None = None  # ring: the first `sinks` slots are kept forever, the rest wrap

    @property
    def n(self) -> int:
        raise NotImplementedError

    @property
    def ids(self) -> list[int]:
        """A copy of the token ids fed since the last reset."""
        return list(self._ids)

    @property
    def sinks(self) -> int | None:
        return self._sinks

    @property
    def ring(self) -> bool:
        return self._sinks is not None

    def recent(self, k: int) -> list[int]:
        """The last k token ids fed (the sampler's repetition window)."""
        return self._ids[-k:] if k > 0 else []

    def enable_ring(self, sinks: int) -> None:
        """Make this (empty) sequence a ring that keeps its first `sinks` slots."""
        if self.n:
            raise ValueError("a ring is set up on an empty sequence")
        if not 0 <= sinks < self.capacity - 1:
            raise EdgeKVError(f"ring cache: {sinks} sink slots leave no ring in a capacity of {self.capacity}")
        self._sinks = sinks

    def disable_ring(self) -> None:
        """Make this sequence linear again (a ring only while it is empty)."""
        if self.ring and self.n:
            raise ValueError("a ring is set up on an empty sequence")
        self._sinks = None

    def _check_capacity(self, n: int) -> None:
        if n > self.capacity:
            raise ContextOverflow(f"snapshot holds {n} tokens, more than the cache capacity {self.capacity}",
                                  setting="capacity", fix="raise {}")

    def _check_positions(self, ids: list[int]) -> None:
        if len(ids) > self.max_positions:
            raise ContextOverflow(f"snapshot holds {len(ids)} positions, more than the {self.max_positions} "
                                  f"this bundle was verified for")


class RingSequence(_Fed):
    def __init__(self, capacity: int, max_positions: int):
        super().__init__(capacity, max_positions)
        self._n = 0  # filled slots: the past the graph sees is slots [0, n)
        self._w = 0  # write slot: the next call's new tokens go to [w, w + S) (== n unless a ring wrapped)
        self._pos = 0  # the next token's RoPE position
        # the graph's key_mask of a decode step, rewritten in place each step (key_mask): the filled
        # past and itself; slots past n (the backend's bucket) and a ring's slots about to be
        # overwritten are masked
        self._mask = np.ones((1, 1, capacity + 1), dtype=np.bool_)

    # -- what it holds (read-only)
    @property
    def n(self) -> int:
        return self._n

    @property
    def w(self) -> int:
        return self._w

    @property
    def pos(self) -> int:
        return self._pos

    @property
    def wrapped(self) -> bool:
        return self.ring and self._n == self.capacity and self._w < self._n

    # -- what the next call may do
    def room(self) -> int:
        """Tokens that may still be fed: free slots (a ring always has some: it overwrites) and
        positions left of the bundle's verified context."""
        slots = self.capacity - self._n if not self.ring else NO_LIMIT
        return min(slots, self.max_positions - self._pos)

    def max_write(self) -> int:
        """The most tokens one call may write: up to the end of the slots (a ring call never
        wraps in the middle; the next one starts again after the sinks)."""
        return self.capacity - self._w

    def check_room(self, s: int) -> None:
        """s more tokens fit (a ring: positions permitting)."""
        if not self.ring and s > self.capacity - self._n:
            raise ContextOverflow(f"context full: {self._n} + {s} tokens exceed the cache capacity of "
                                  f"{self.capacity}", setting="capacity", fix="raise {}")
        if s > self.max_positions - self._pos:
            raise ContextOverflow(f"positions full: {self._pos} + {s} tokens exceed the {self.max_positions} "
                                  f"positions this bundle was verified for")

    def check_write(self, s: int) -> None:
        """One graph call may write s tokens at the write slot (a ring's call may not wrap)."""
        self.check_room(s)
        if s > self.max_write():
            raise ContextOverflow(f"ring cache: a call of {s} tokens would wrap; at most {self.max_write()} now")

    def positions(self, s: int) -> np.ndarray:
        """position_ids [1, s] of the next call's tokens."""
        return np.arange(self._pos, self._pos + s, dtype=np.int64)[None]

    def key_mask(self, s: int, past: int | None = None) -> np.ndarray:
        """key_mask [1, s, past + s] of the next call of s tokens: which keys each new token sees
        (the filled past, and the new block causally). `past` is how many slots the backend binds
        as the past (at least n, default n): slots [n, past) hold nothing of this sequence and
        are masked."""
        n = self._n
        p = n if past is None else past
        if not n <= p <= self.capacity:
            raise ValueError(f"a past of {p} slots for a sequence of {n} in {self.capacity}")
        evicting = self.ring and self._w < n  # slots being overwritten: their old keys leave the context now
        if s == 1:  # a decode step: the preallocated row, no allocation per step
            m = self._mask[:, :, : p + 1]
            m[:] = True
        else:
            m = np.ones((1, s, p + s), dtype=np.bool_)
            m[0, :, p:] = np.tri(s, dtype=np.bool_)
        m[0, :, n:p] = False
        if evicting:
            m[0, :, self._w: self._w + s] = False
        return m

    # -- changes
    def advance(self, ids) -> None:
        """A call wrote the K/V of `ids` at the write slot."""
        s = len(ids)
        self._ids.extend(int(t) for t in ids)
        self._pos += s
        self._w += s
        self._n = max(self._n, self._w)
        if self.ring and self._w == self.capacity:
            self._w = self._sinks

    def reset(self, pos: int = 0) -> None:
        """Forget everything; the next token gets position `pos`."""
        self._n = self._w = 0
        self._pos = pos
        self._ids = []

    def truncate(self, n: int) -> None:
        """Forget everything after the first n slots (undo / regenerate)."""
        if not 0 <= n <= self._n or self.wrapped or len(self._ids) != self._n:
            raise ValueError(f"cannot truncate a sequence of {self._n} tokens to {n}"
                             + (" (the ring has wrapped)" if self.wrapped else ""))
        self._pos -= self._n - n
        self._n = self._w = n
        del self._ids[n:]

    def check_restore(self, n: int, ids: list[int], w: int | None = None) -> None:
        """`restore` would accept this saved state (an error saying why not; nothing changes)."""
        self._check_capacity(n)
        if w is not None and w != n:  # a ring that had wrapped: the next write goes to its old slot
            if not self.ring or not self._sinks <= w < n == self.capacity:
                raise EdgeKVError("snapshot of a wrapped ring does not fit this cache")
            if len(ids) < n:
                raise EdgeKVError("snapshot holds more slots than token ids")
        elif len(ids) != n:  # slot i holds the token fed at position i
            raise EdgeKVError(f"snapshot holds {n} slots but {len(ids)} token ids")
        self._check_positions(ids)

    def restore(self, n: int, ids: list[int], w: int | None = None) -> None:
        """Take the state of a saved sequence whose first n slots were just restored: the token
        ids it had been fed (from position 0) and, for a ring that had wrapped, its write slot."""
        self.check_restore(n, ids, w)
        self._n = n
        self._w = n if w is None else w
        self._ids = [int(t) for t in ids]
        self._pos = len(self._ids)  # positions run with the conversation, also past a ring's wrap
