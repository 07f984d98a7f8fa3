"""Snapshots of a pool sequence (chat's /save, /load and --prompt-cache): host copies of its cells
in position order (KVManager.snapshot), beside them in a windowed pool its window ring's rows
(window_rings.RING keys), and the token ids it was fed. `check` says whether one loads into a
sequence before anything changes (Batcher.restore and chat's file reader both ask it);
`in_position_order` reads the files saved before the pool, whose wrapped ring's slots were in
slot order (its oldest token at slot w, after the sinks)."""
from __future__ import annotations

import numpy as np

from edgekv.errors import EdgeKVError
from edgekv.runtime.batching.poolseq import PoolSequence
from edgekv.runtime.batching.window_rings import RING, split_window
from edgekv.runtime.cache import KVCache


def slots_in(cache: KVCache, snap: dict[str, np.ndarray]) -> int:
    """The cells a snapshot holds; an error unless it fits this pool: its cells' buffers, and
    beside them a windowed pool's ring part or, from a cache that keeps every position, the
    local layers' rows of the same cells (a windowed pool takes its ring from those)."""
    cells, _ = split_window(snap)
    names = cache.cell_names
    n = cache.slots_in({k: v for k, v in cells.items() if k in names})
    for k in set(cells) - set(names):
        if k not in cache.local_names or cells[k].shape != (n, *cache.shapes[k][1:]) \
                or cells[k].dtype != cache.dtypes[k]:
            raise EdgeKVError("snapshot does not match this cache's layout")
    return n


def check(cache: KVCache, seq: PoolSequence, snap: dict[str, np.ndarray], ids: list[int], w: int | None,
          sinks: int | None) -> int:
    """The cells of a snapshot that `seq` (a ring: with `sinks`, None its own) would take whole;
    an error saying why not. `w`: a wrapped ring's write slot in a file saved in slot order. (A
    windowed pool's ring part is its KV manager's to check: Batcher.check_restore.)"""
    n = slots_in(cache, snap)
    seq.check_restore(n, ids)  # (first: a wrapped ring's into a sequence that is none says so)
    if seq.ring and sinks is not None:
        seq.check_sinks(sinks)
    if w is not None and w != n and not (seq.ring and (seq.sinks if sinks is None else sinks) <= w < n):
        raise EdgeKVError("snapshot of a wrapped ring does not fit this cache")
    return n


def in_position_order(snap: dict[str, np.ndarray], n: int, w: int | None, sinks: int | None) -> dict[str, np.ndarray]:
    """A checked snapshot's cells in position order (an old file's wrapped ring: its sinks, then
    slots w.. n, then the slots after the sinks up to w)."""
    if w is None or w == n:
        return snap
    cells, ring = split_window(snap)
    order = np.r_[0: sinks, w: n, sinks: w]
    return {**{k: v[order] for k, v in cells.items()}, **{RING + k: v for k, v in ring.items()}}
