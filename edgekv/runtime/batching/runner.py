"""The step runners: a call in, the backend's logits rows out. Each builds the graph's inputs,
runs it once, and decides nothing. StepRunner runs the cell pool's calls (plan.py): the ids,
the positions, the per-token mask and the logits index. SlotRunner runs fused slots' (slots.py).

The mask [1, S, P + S] says per token which cells of the past are its own sequence's (wherever
they lie: a shared prefix, a ring's wrapped layout) and which earlier tokens of the batch it
sees (its own piece's, causally). A model with sliding-window layers (cache.window) also gets
their mask: of those keys, the ones whose position is within the window of the token's
(q_pos - k_pos < window), each cell's position from its sequence (PoolSequence.cell_positions)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from edgekv.errors import EdgeKVError
from edgekv.runtime.backends.base import Backend
from edgekv.runtime.batching.plan import Call, SlotCall
from edgekv.runtime.cache import KVCache

if TYPE_CHECKING:
    from edgekv.runtime.batching.window_rings import NoWindowRings, WindowRings


class StepRunner:
    def __init__(self, backend: Backend, cache: KVCache, window_rings: "WindowRings | NoWindowRings | None" = None):
        self.backend, self.cache = backend, cache
        self.window_rings = window_rings  # a windowed pool's: where a call's kept local K/V go (`writes`)
        self.calls = 0

    def inputs(self, call: Call) -> tuple[np.ndarray, ...]:
        """(input_ids [1, S], position_ids [1, S], key_mask [1, S, P + S], logits_index [1, K])."""
        s, p = call.size, call.past
        ids = np.empty((1, s), np.int64)
        pos = np.empty((1, s), np.int64)
        mask = np.zeros((1, s, p + s), np.bool_)
        rows, r = [], 0
        for piece in call.pieces:
            tokens, seq = piece.tokens, piece.seq
            n = len(tokens)
            cells = seq.cell_view()
            ids[0, r: r + n] = tokens
            if cells:
                mask[0, r: r + n, cells] = True  # its own past, wherever its cells are
            if n == 1:  # a decode token (most pieces): the same as below, without np.arange / np.tri
                pos[0, r] = seq.pos
                mask[0, r, p + r] = True
            else:
                pos[0, r: r + n] = seq.pos + np.arange(n)
                mask[0, r: r + n, p + r: p + r + n] = np.tri(n, dtype=np.bool_)  # its new tokens, causally
            k = max(piece.scored, int(piece.sample))  # Piece.rows, without the property call
            if k:
                rows.extend(range(r + n - k, r + n))  # its last k tokens' rows
            r += n
        idx = np.asarray([rows or [s - 1]], np.int64)  # a call samples nothing: any one row
        return ids, pos, mask, idx

    def local_mask(self, call: Call, pos: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """local_key_mask [1, S, P + S]: `mask` [1, S, P + S] and the window, per piece (its past
        cells' positions and its own new tokens'); `pos` the call's position_ids [1, S]."""
        p, window = call.past, self.cache.window
        local = np.zeros_like(mask)
        r = 0
        for piece in call.pieces:
            n, seq = len(piece.tokens), piece.seq
            cells = seq.cell_view()
            q = pos[0, r: r + n, None]  # [n, 1]
            if cells:
                local[0][r: r + n, cells] = q - seq.cell_positions()[None] < window  # [n, cells]
            local[0, r: r + n, p + r: p + r + n] = q - pos[0, None, r: r + n] < window  # its own new tokens
            r += n
        return local & mask

    def window_mask(self, call: Call, pos: np.ndarray) -> np.ndarray:
        """A windowed pool's local_key_mask [1, S, L + S], L every ring's slots: per piece its own
        ring's slots whose position is within the window, and its own new tokens (causally)."""
        ring, window, s = self.cache.local_ring, self.cache.window, call.size
        L = ring * self.cache.rings
        local = np.zeros((1, s, L + s), np.bool_)
        r = 0
        for piece in call.pieces:
            n, seq = len(piece.tokens), piece.seq
            q = pos[0, r: r + n, None]  # [n, 1]
            held = seq.window_positions()  # [ring]: -1 where none
            base = seq.window_ring * ring
            local[0, r: r + n, base: base + ring] = (held >= 0)[None] & (q - held[None] < window)
            d = q - pos[0, None, r: r + n]
            local[0, r: r + n, L + r: L + r + n] = (d >= 0) & (d < window)
            r += n
        return local

    def run(self, call: Call) -> np.ndarray:
        """logits [K, V]: each returned piece's rows, in the call's order (a view into the
        backend's buffer, valid until the next call)."""
        ids, pos, mask, idx = self.inputs(call)
        if self.cache.local_ring is not None:  # a windowed pool: the local layers read and write their rings
            logits = self.backend.run_cells(self.cache, call.past, call.write, ids, pos, mask, idx,
                                            local_key_mask=self.window_mask(call, pos),
                                            ring=self.window_rings.writes(call))
        elif self.cache.window is None:
            logits = self.backend.run_cells(self.cache, call.past, call.write, ids, pos, mask, idx)
        else:  # a model with sliding-window layers: their mask too
            logits = self.backend.run_cells(self.cache, call.past, call.write, ids, pos, mask, idx,
                                            local_key_mask=self.local_mask(call, pos, mask))
        self.calls += 1
        return logits[0]


class SlotRunner:
    """A SlotCall in, the backend's logits rows out (run_slots): the ids right-padded to the
    longest entry, each entry's length and valid tokens, its rows' indices."""

    def __init__(self, backend, cache: KVCache):
        if not hasattr(backend, "run_slots"):
            raise EdgeKVError(f"fused slots need a backend that runs them (ort-cpu's fused graph); {backend.name} does not")
        self.backend, self.cache = backend, cache
        self.calls = 0

    def inputs(self, call: SlotCall) -> tuple[np.ndarray, ...]:
        """(input_ids [B, S], lengths [B], query_lengths [B], logits_index [B, K])."""
        b = len(call.entries)
        s = max(len(p.tokens) for p in call.pieces)
        k = max([r for _, r in call.returned] or [1])
        ids = np.zeros((b, s), np.int64)
        lengths = np.zeros(b, np.int64)
        query = np.zeros(b, np.int32)
        idx = np.zeros((b, k), np.int64)
        for e, p in enumerate(call.entries):
            if p is None:
                continue
            n = len(p.tokens)
            ids[e, :n], lengths[e], query[e] = p.tokens, p.seq.n, n
            rows = max(p.rows, 1)
            idx[e, :rows] = np.arange(n - rows, n)
            idx[e, rows:] = n - 1  # padding rows: never read
        return ids, lengths, query, idx

    def run(self, call: SlotCall) -> np.ndarray:
        """logits [K, V]: each returned piece's rows, in the call's order."""
        ids, lengths, query, idx = self.inputs(call)
        logits = self.backend.run_slots(self.cache, call.first, ids, lengths, query, idx)
        self.calls += 1
        at = {id(p): e for e, p in enumerate(call.entries) if p is not None}
        return np.concatenate([logits[at[id(p)], :k] for p, k in call.returned]) if call.returned \
            else logits[0, :0]
