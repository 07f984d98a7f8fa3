"""Post-processing: the one place a returned logits row becomes a request's token. Per row: the
constraint's mask, sampling, the constraint's accept, stop tokens, the token event, the end at
max_tokens (or when the constraint is done), and the finish that frees the cells. One request's
error ends only it (a kept sequence's — chat — is raised: its turn rolls back).

The constraints' masks are computed off the critical path (vLLM overlaps them with the step):
a constrained sequence's state for this step is known once the last step's token was accepted,
so `masks_ahead(call)` computes them on a worker thread while the backend runs the call's graph
(onnxruntime and llguidance's mask fill release the GIL), and `process` joins it before it
samples. The masks are the same either way (each constraint caches the mask of its state). The
batcher turns it on for device backends, whose run leaves the CPU free (measured on ort-cpu it
only waited: docs/structured.md)."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from edgekv.errors import NonFinite, note
from edgekv.runtime.batching.plan import Call
from edgekv.runtime.batching.request import CLOSING, Request, Token
from edgekv.runtime.batching.scheduler import Scheduler
from edgekv.runtime.constraint import constrain
from edgekv.runtime.sampling import logprobs, sample

# steps in a row that failed every request they sampled (non-finite logits) or raised: the batcher
# is failing everything (`Batcher.fault`); one good row resets it
FAULT_STEPS = 3


class Health:
    """Whether the batcher is failing everything: the last FAULT_STEPS steps each raised or had
    only non-finite rows among those it sampled (a request's own sampling error does not count:
    one client must not make the server look down). Written by the stepping thread, read by any."""

    def __init__(self):
        self.failed_steps, self.reason = 0, ""
        self.good = self.bad = 0  # rows of the step under way

    def row(self, finite: bool) -> None:
        if finite:
            self.good += 1
        else:
            self.bad += 1

    def step_ended(self, error: str | None = None) -> None:
        if error is None and self.good:
            self.failed_steps = 0
        elif error is not None or self.bad:
            self.failed_steps, self.reason = self.failed_steps + 1, error or NonFinite.MESSAGE
        self.good = self.bad = 0

    def fault(self) -> str | None:
        n = self.failed_steps
        return f"the last {n} batcher steps failed every request in them: {self.reason}" if n >= FAULT_STEPS else None


class PostProcess:
    def __init__(self, scheduler: Scheduler, health: Health, overlap_masks: bool = False):
        self.scheduler, self.health = scheduler, health
        self.generated_tokens = 0
        self.overlap_masks = overlap_masks  # False: each mask computed when its row is sampled
        self._masker: ThreadPoolExecutor | None = None  # started by the first constrained call
        self._ahead: Future | None = None  # the masks being computed for the call under way

    def masks_ahead(self, call: Call) -> None:
        """Start computing the masks of the call's constrained rows (before the backend runs it)."""
        self._join()
        todo = [p.req.ask.constraint for p in call.pieces if p.sample and p.req.ask.constraint is not None
                and not (p.req.cancelled or p.req.state is CLOSING)]  # (a closing one only feeds its last token)
        if not todo or not self.overlap_masks:
            return
        if self._masker is None:
            self._masker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgekv-masks")
        self._ahead = self._masker.submit(_fill, todo)

    def _join(self) -> None:
        """Wait for the masks started ahead: no constraint is touched while the worker has it."""
        if self._ahead is not None:
            self._ahead.result()
            self._ahead = None

    def close(self) -> None:
        self._join()
        if self._masker is not None:
            self._masker.shutdown()
            self._masker = None

    def process(self, call: Call, logits: np.ndarray) -> None:
        """logits [K, V]: the rows of the call's returned pieces, in order."""
        self._join()
        j = 0
        for piece, k in call.returned:
            req = piece.req
            rows, j = logits[j: j + k], j + k
            if piece.scored:
                req.scored(rows[k - piece.scored:])
            if not piece.sample:
                continue
            try:
                self._row(req, rows[-1])
            except Exception as e:
                if req.kept:  # chat: the turn is rolled back
                    raise
                self._fail(req, e)

    def _row(self, req: Request, row: np.ndarray) -> None:
        if req.state is CLOSING:  # its last token is in the cells now
            self.scheduler.finish(req, req.end_reason)
        elif req.max_new == 0:  # only fed (a kept sequence's prompt)
            self.scheduler.finish(req, "length")
        else:
            self._sample(req, row)

    def _fail(self, req: Request, e: Exception) -> None:
        """One request's sampling or stop handling raised: it alone ends, finish reason "error"
        (one that had ended already, its emit raising inside `finish`, keeps its reason)."""
        note(f"batcher: a request failed: {type(e).__name__}: {e}")
        if req not in self.scheduler.running:
            return
        try:
            self.scheduler.finish(req, "error", f"{type(e).__name__}: {e}")
        except Exception as again:  # its emit is broken: it has left all the same
            note(f"batcher: a request's emit failed: {type(again).__name__}: {again}")

    def _sample(self, req: Request, row: np.ndarray) -> None:
        if req.cancelled:
            return  # dropped at the next step
        finite = bool(np.isfinite(row).all())
        self.health.row(finite)
        if not finite:  # damaged weights or an overflow: never sample from it
            if req.kept:  # chat: the turn is rolled back
                raise NonFinite()
            note(f"batcher: {NonFinite.MESSAGE}")
            self.scheduler.finish(req, "error", NonFinite.MESSAGE)
            return
        ask = req.ask
        history = req.seq.recent(ask.params.repeat_last_n) if ask.params.repeat_penalty != 1.0 else []
        c = ask.constraint
        seen = constrain(row, c)  # a GrammarError from the constraint ends this request alone
        tok = sample(seen, ask.params, req.rng, history)
        # from what the sampler saw, before the history grows
        lp = None if ask.logprobs is None else logprobs(seen, ask.params, history, tok, ask.logprobs)
        if c is not None:
            c.accept(tok)
        ttft = req.sampled(tok, row)
        reason = None
        if tok in ask.stop_ids:
            reason = "stop"
        else:
            req.add(tok)
            self.generated_tokens += 1
            if ask.emit:
                ask.emit(Token(tok, ttft, None if ttft is None else req.reused, lp))
            if len(req.out) >= req.max_new:
                reason = req.limit_reason
            elif c is not None and c.is_done():
                reason = "stop"
        if reason is None:
            req.goes_on(tok)
        elif ask.feed_last and req.seq.can_feed():
            req.goes_on(tok, reason)  # fed at the next step, then it ends
        else:
            self.scheduler.finish(req, reason)


def _fill(constraints) -> None:
    """Each constraint's mask of its current state, computed and kept by the constraint itself.
    An error is left for the row's own `allowed()` to raise again (it ends that request alone)."""
    for c in constraints:
        try:
            c.allowed()
        except Exception:  # noqa: BLE001 (raised again where the row is sampled)
            pass
