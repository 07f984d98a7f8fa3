"""A REFERENCE IMPLEMENTATION FOR TESTS ONLY: one stream over a cache of its own, as edgekv ran
generate, eval and bench before every command became requests through the batcher (issue 42).

Product code has one engine (edgekv/runtime/batching/: a single stream is a one-request run,
runtime/batching/stream.py). This is its oracle: a second, simpler bookkeeping of the same graph
calls (slot i holds position i; the filled past bound at the backend's bucket with its tail
masked; a windowed cache's local layers in one ring, position p in slot p mod its length), written
without the batcher's scheduler, cell pool, KV manager or step runner, so a test that compares
the two does not check that code with itself. Each call goes through the backend's one entry
point, run_cells (`run_stream`). tests/ring_reference.py builds the StreamingLLM ring on it."""
from __future__ import annotations

import numpy as np

from edgekv.errors import ContextOverflow, EdgeKVError, NonFinite
from edgekv.runtime.backends.base import PREFILL_CHUNK, bound_past
from edgekv.runtime.cache import KVCache


class Sequence:
    wrapped = False  # a single stream never wraps (the stats line asks every sequence)

    def __init__(self, capacity: int, max_positions: int, window: int | None = None, local_ring: int | None = None):
        self.capacity = capacity  # slots it may fill
        self.max_positions = max_positions  # positions the bundle was verified for
        self.window = window  # the local layers' sliding window (None: the model has none)
        self.local_ring = local_ring  # the local layers' slots in a windowed cache (None: they hold every slot)
        self._ids: list[int] = []  # token ids fed since the last reset, in order
        self._n = 0  # filled slots: the past the graph sees is slots [0, n)
        self._pos = 0  # the next token's RoPE position
        # the graph's key_mask of a decode step, rewritten in place each step (key_mask)
        self._mask = np.ones((1, 1, capacity + 1), dtype=np.bool_)

    # -- what it holds (read-only)
    @property
    def n(self) -> int:
        return self._n

    @property
    def pos(self) -> int:
        return self._pos

    @property
    def ids(self) -> list[int]:
        """A copy of the token ids fed since the last reset."""
        return list(self._ids)

    def recent(self, k: int) -> list[int]:
        """The last k token ids fed (the sampler's repetition window)."""
        return self._ids[-k:] if k > 0 else []

    # -- what the next call may do
    def room(self) -> int:
        """Tokens that may still be fed: free slots and positions left of the verified context."""
        return min(self.capacity - self._n, self.max_positions - self._pos)

    def max_write(self) -> int:
        """The most tokens one call may write: up to the end of the slots."""
        return self.capacity - self._n

    def check_room(self, s: int) -> None:
        """s more tokens fit."""
        if s > self.capacity - self._n:
            raise ContextOverflow(f"context full: {self._n} + {s} tokens exceed the cache capacity of "
                                  f"{self.capacity}", setting="capacity", fix="raise {}")
        if s > self.max_positions - self._pos:
            raise ContextOverflow(f"positions full: {self._pos} + {s} tokens exceed the {self.max_positions} "
                                  f"positions this bundle was verified for")

    def positions(self, s: int) -> np.ndarray:
        """position_ids [1, s] of the next call's tokens."""
        return np.arange(self._pos, self._pos + s, dtype=np.int64)[None]

    def key_mask(self, s: int, past: int | None = None) -> np.ndarray:
        """key_mask [1, s, past + s] of the next call of s tokens: which keys each new token sees
        (the filled past, and the new block causally). `past` is how many slots the backend binds
        as the past (at least n, default n): slots [n, past) hold nothing and are masked."""
        n = self._n
        p = n if past is None else past
        if not n <= p <= self.capacity:
            raise ValueError(f"a past of {p} slots for a sequence of {n} in {self.capacity}")
        if s == 1:  # a decode step: the preallocated row, no allocation per step
            m = self._mask[:, :, : p + 1]
            m[:] = True
        else:
            m = np.ones((1, s, p + s), dtype=np.bool_)
            m[0, :, p:] = np.tri(s, dtype=np.bool_)
        m[0, :, n:p] = False
        return m

    def local_key_mask(self, s: int, past: int | None = None) -> np.ndarray | None:
        """local_key_mask [1, s, past + s] of the next call (None for a model without local
        layers): key_mask's keys within the window, q_pos - k_pos < window. Slot i holds position
        pos - n + i (a linear cache that may have started at any position: reset(pos)). In a
        windowed cache `past` counts the local layers' slots (default: the filled ones)."""
        if self.window is None:
            return None
        if self.local_ring is not None:
            return self._ring_mask(s, self.local_filled() if past is None else past)
        m = self.key_mask(s, past).copy()  # key_mask's decode row is reused: not written here
        p = m.shape[2] - s
        q = np.arange(self._pos, self._pos + s)
        k = np.concatenate([np.arange(p) + (self._pos - self._n), q])  # slots [n, p): masked already
        m[0] &= (q[:, None] - k[None, :]) < self.window
        return m

    # -- the local layers' ring (a windowed cache)
    def local_filled(self) -> int:
        """The local layers' slots that hold a token: the first min(n, ring)."""
        return min(self._n, self.local_ring)

    def local_positions(self, past: int) -> np.ndarray:
        """The position each of the local slots [0, past) holds, -1 where none: slot j holds the
        last token fed whose index i (since the reset) is j mod ring."""
        n, r = self._n, self.local_ring
        j = np.arange(past)
        i = (n - 1) - ((n - 1 - j) % r)  # the latest index < n in slot j
        return np.where((j < min(n, r)) & (i >= 0), self._pos - n + i, -1)

    def local_slots(self, s: int) -> tuple[int, np.ndarray]:
        """Where the next call's K/V go in the local layers: (the first of its s tokens that is
        kept, their slots); only the last `ring` of a longer call stay."""
        first = max(0, s - self.local_ring)
        return first, (self._n + np.arange(first, s)) % self.local_ring

    def _ring_mask(self, s: int, past: int) -> np.ndarray:
        if not 0 <= past <= self.local_ring:
            raise ValueError(f"a local past of {past} slots in a ring of {self.local_ring}")
        q = np.arange(self._pos, self._pos + s)
        kp = self.local_positions(past)
        m = np.zeros((1, s, past + s), dtype=np.bool_)
        m[0, :, :past] = (kp[None, :] >= 0) & (q[:, None] - kp[None, :] < self.window)
        d = q[:, None] - q[None, :]  # the new block: causal and within the window
        m[0, :, past:] = (d >= 0) & (d < self.window)
        return m

    # -- changes
    def advance(self, ids) -> None:
        """A call wrote the K/V of `ids` after the filled slots."""
        self._ids.extend(int(t) for t in ids)
        self._pos += len(ids)
        self._n += len(ids)

    def reset(self, pos: int = 0) -> None:
        """Forget everything; the next token gets position `pos`."""
        self._n = 0
        self._pos = pos
        self._ids = []

    def truncate(self, n: int) -> None:
        """Forget everything after the first n slots (undo / regenerate)."""
        if not 0 <= n <= self._n or len(self._ids) != self._n:
            raise ValueError(f"cannot truncate a sequence of {self._n} tokens to {n}")
        if self.local_ring is not None and n < self._n and self._n > self.local_ring:
            # the local layers' slots of the tokens before n were overwritten by those after it
            raise EdgeKVError(f"a windowed cache cannot truncate {self._n} tokens to {n}: its local layers keep "
                              f"only the last {self.local_ring}")
        self._pos -= self._n - n
        self._n = n
        del self._ids[n:]

    def check_restore(self, n: int, ids: list[int]) -> None:
        """`restore` would accept this saved state (an error saying why not; nothing changes)."""
        if n > self.capacity:
            raise ContextOverflow(f"snapshot holds {n} tokens, more than the cache capacity {self.capacity}",
                                  setting="capacity", fix="raise {}")
        if len(ids) != n:  # slot i holds the token fed at position i
            raise EdgeKVError(f"snapshot holds {n} cells but {len(ids)} token ids")
        if len(ids) > self.max_positions:
            raise ContextOverflow(f"snapshot holds {len(ids)} positions, more than the {self.max_positions} "
                                  f"this bundle was verified for")

    def restore(self, n: int, ids: list[int]) -> None:
        """Take the state of a saved sequence whose first n slots were just restored: the token
        ids it had been fed (from position 0)."""
        self.check_restore(n, ids)
        self._n = n
        self._ids = [int(t) for t in ids]
        self._pos = n


def new_sequence(cache: KVCache) -> Sequence:
    """A sequence over this cache's slots."""
    return Sequence(cache.capacity, cache.max_positions, cache.window, cache.local_ring)


def run_stream(backend, cache: KVCache, seq: Sequence, ids: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
    """One graph call of ids [1, S] after the sequence's filled slots (it is not changed): the past
    bound at the backend's bucket, the tail masked; a windowed cache's local layers bind their
    whole ring, unfilled slots masked, and the call's kept tokens go to their ring slots."""
    s = ids.shape[1]
    past = bound_past(seq.n, backend.past_bucket, cache.capacity)
    if cache.local_ring is None:
        ring, local = None, seq.local_key_mask(s, past)
    else:
        if cache.local_ring != seq.local_ring or cache.rings != 1:
            raise EdgeKVError("a windowed cache of one ring runs its own sequences (new_sequence(cache))")
        first, slots = seq.local_slots(s)
        ring, local = (np.arange(first, s), slots), seq.local_key_mask(s, cache.local_ring)
    return backend.run_cells(cache, past, seq.n, ids, seq.positions(s), seq.key_mask(s, past), logits_index,
                             local, ring)


def reference(rt, capacity: int | None = None, prefill_chunk: int = PREFILL_CHUNK, cache: KVCache | None = None):
    """A reference generator over a new sequence of the runtime `rt`: in `cache`, or in a new
    windowed cache of `capacity` cells (where the bundle and the backend allow it)."""
    if cache is None:
        windowed = getattr(rt.backend, "windows_cache", False)
        cache = KVCache(rt.bundle, capacity or rt.capacity, memory=rt.backend.memory, windowed=windowed)
    return Generator(rt.backend, cache, prefill_chunk=prefill_chunk)


class Generator:
    """Runs one sequence over a cache through a backend (run_stream). Each graph call is checked against the
    sequence before it runs and recorded in it after (`_call`), so an interrupted call leaves
    the sequence as it was."""

    def __init__(self, backend, cache: KVCache, seq: Sequence | None = None, prefill_chunk: int = PREFILL_CHUNK):
        self.backend, self.cache = backend, cache
        self.seq = seq if seq is not None else new_sequence(cache)
        self.prefill_chunk = min(prefill_chunk, backend.max_tokens_per_call)

    def reset(self, pos: int = 0) -> None:
        self.seq.reset(pos)

    def truncate(self, n: int) -> None:
        self.seq.truncate(n)

    def snapshot(self) -> dict[str, np.ndarray]:
        """The filled slots, in position order."""
        self._whole_cells()
        return self.cache.read(self.seq.n)

    def _whole_cells(self) -> None:
        if self.cache.local_ring is not None:  # (chat's batcher snapshots a windowed pool, with its rings)
            raise EdgeKVError("a windowed cache (its local layers keep only their window) has no snapshot of its slots")

    def restore(self, snap: dict[str, np.ndarray], ids: list[int]) -> None:
        """Continue a saved sequence: its slots and the token ids it was fed."""
        self._whole_cells()
        n = self.cache.slots_in(snap)
        self.seq.check_restore(n, ids)  # both checked before either changes
        self.cache.write(snap)
        self.seq.restore(n, ids)

    def _call(self, ids: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        """One graph call: ids [1, S] after the filled slots; logits [1, K, V] of the rows asked for."""
        self.seq.check_room(ids.shape[1])
        logits = run_stream(self.backend, self.cache, self.seq, ids, logits_index)
        if not np.isfinite(logits).all():  # damaged weights or an overflow: never sample from it
            raise NonFinite()
        self.seq.advance(ids[0])
        return logits

    def prefill(self, ids: list[int], all_logits: bool = False, logits_from: int = 0) -> np.ndarray:
        """Feed ids in chunks; return the last token's logits [V], or with all_logits those of
        every token from index `logits_from` on [S - logits_from, V] (the head runs only there)."""
        if not ids:
            raise EdgeKVError("empty prompt: nothing to feed the model")
        self.seq.check_room(len(ids))  # the whole prompt, before any of it is fed
        out = []
        last = None
        start = 0
        while start < len(ids):
            # a ring takes a call only up to the end of its slots
            step = min(self.prefill_chunk, self.seq.max_write())
            chunk = np.asarray(ids[start: start + step], np.int64)[None]  # [1, S]
            s = chunk.shape[1]
            first = max(0, logits_from - start)  # rows of this chunk that are wanted
            wanted = all_logits and first < s
            idx = (np.arange(first, s) if wanted else np.array([s - 1]))[None].astype(np.int64)
            logits = self._call(chunk, idx)
            start += s
            if wanted:
                out.append(logits[0].copy())
            else:
                last = logits[0, -1]
        return np.concatenate(out) if all_logits else last

    def decode_step(self, token: int) -> np.ndarray:
        """One token in, its logits [V] out (a view; valid until the next call)."""
        return self._call(np.full((1, 1), token, np.int64), np.zeros((1, 1), np.int64))[0, 0]
