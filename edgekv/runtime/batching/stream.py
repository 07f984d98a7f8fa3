"""One sequence fed through the batcher call by call: what the commands that score or time a
single stream drive (eval, eval-context, bench, the export's parity check, the Jetson's
self-test). Each call is a one-request run of the batcher (`Batcher.run`, as a chat turn is), so
they run the schedule, cells, graph calls and post-processing that chat and serve run."""
from __future__ import annotations

import numpy as np

from edgekv.errors import ContextOverflow, EdgeKVError, NonFinite
from edgekv.runtime.batching.batcher import Batcher
from edgekv.runtime.batching.request import Request


class Stream:
    def __init__(self, batcher: Batcher):
        self.batcher = batcher
        self.seq = batcher.hold()  # its cells stay in the pool between calls

    @property
    def cache(self):
        return self.batcher.cache

    def reset(self) -> None:
        self.batcher.reset(self.seq)

    def prefill(self, ids: list[int], all_logits: bool = False, logits_from: int = 0) -> np.ndarray:
        """Feed ids after what the sequence holds; return the last token's logits [V], or with
        all_logits those of every token from index `logits_from` on [S - logits_from, V]."""
        if not len(ids):
            raise EdgeKVError("empty prompt: nothing to feed the model")
        if len(ids) > self.seq.room():
            raise ContextOverflow(f"{len(ids)} tokens do not fit: {self.seq.room()} of the cache's "
                                  f"{self.cache.capacity} are left", setting="capacity", fix="raise {}")
        first = min(logits_from, len(ids) - 1) if all_logits else len(ids) - 1
        req = self.batcher.run(Request(ids, 0, seq=self.seq, logits_from=first))
        rows = np.stack(req.logits)
        if not np.isfinite(rows).all():  # damaged weights or an overflow: never score or sample from it
            raise NonFinite()
        return rows if all_logits else rows[-1]

    def decode_step(self, token: int) -> np.ndarray:
        """One token in, its logits [V] out."""
        return self.prefill([token])
