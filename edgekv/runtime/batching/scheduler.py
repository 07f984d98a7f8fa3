"""The scheduler: the queue, admission, cell reservations and each request's state; `schedule`
returns the next step's pieces (plan.py) as plain data.

Every running request's next token goes into one call, then up to `prefill_chunk` tokens of the
feeds still going in, so a new request joins at the next step and running streams never wait for
a whole prompt. Cells are reserved on demand: admission reserves a request's feed and HEADROOM
more, a decoding request claims more HEADROOM at a time, and when the pool runs out the youngest
running request is preempted (its cells freed, its prompt and reply so far prefilled again when
it is readmitted: vLLM's recompute), so one request's large max_tokens does not hold the pool for
the others. A kept sequence's request (chat) reserves all it may add at once and is never
preempted. Requests that cannot start wait in a bounded queue (`QueueFull` past it)."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from edgekv.errors import ContextOverflow, EdgeKVError, QueueFull
from edgekv.runtime.batching.kv import KVManager
from edgekv.runtime.batching.plan import Call, Piece
from edgekv.runtime.batching.request import DECODES, PREFILLING, Request

# cells a request reserves beyond its prompt at admission, and claims at a time while it decodes:
# enough that a new request does not preempt at once, small beside a pool (docs/serve.md)
HEADROOM = 16


@dataclass
class SchedulerCounters:
    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    preempted: int = 0


class Scheduler:
    def __init__(self, kv: KVManager, parallel: int, max_queue: int, prefill_chunk: int, max_tokens_per_call: int):
        self.kv = kv
        self.parallel, self.max_queue, self.prefill_chunk = parallel, max_queue, prefill_chunk
        self.max_tokens_per_call = max_tokens_per_call
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cond = threading.Condition()  # guards `waiting` (submit runs on any thread)
        self.counters = SchedulerCounters()
        self._arrivals = 0

    # -- from any thread
    def drop_all(self) -> None:
        """Forget every waiting and running request (a rolled-back turn: the pool's undo puts the
        cells back; nothing is emitted)."""
        with self.cond:
            self.waiting.clear()
        self.running.clear()

    def submit(self, req: Request) -> Request:
        """Queue a request (it may generate max_tokens capped to the room left after its prompt).
        QueueFull when it could not start at the next step and `max_queue` requests wait already
        (`max_queue` 0: nothing waits, a request that can start now still starts)."""
        prompt = req.ask.prompt
        if not prompt:
            raise EdgeKVError("empty prompt: nothing to feed the model")
        max_new, limit_reason = req.ask.max_tokens, "length"
        if not req.kept:
            if len(prompt) >= self.kv.limit:
                raise ContextOverflow(f"the prompt has {len(prompt)} tokens; {self.kv.limit_words} "
                                      f"(prompt and at least one new token)", setting="capacity", fix="raise {}")
            max_new = max(1, min(req.ask.max_tokens, self.kv.limit - len(prompt)))
        else:
            room = req.ask.seq.room()
            if len(prompt) > room:
                raise ContextOverflow(f"context full: {len(prompt)} more tokens, room for {room} (cells, and "
                                      f"positions of the {self.kv.cache.max_positions} verified)", setting="capacity",
                                      fix="raise {}")
            # the last sampled token needs no room when it is not fed (a reply cut at the context's end)
            cap = room - len(prompt) + 1
            if max_new > cap:
                max_new, limit_reason = cap, "context"
        req.queued(max_new, limit_reason)
        with self.cond:
            if self._queued_behind() >= self.max_queue and self._would_wait(req):
                raise QueueFull(f"the wait queue is full ({self.max_queue} requests may wait)")
            self._arrivals += 1
            req.arrived(self._arrivals)
            self.waiting.append(req)
            self.cond.notify()
        return req

    def _queued_behind(self) -> int:
        """Waiting requests beyond the slots the next step admits into (with self.cond held)."""
        return max(0, len(self.waiting) - max(0, self.parallel - len(self.running)))

    def _would_wait(self, req: Request) -> bool:
        """`req` would not start at the next step: no slot left for it, or the cells the
        requests before it and it reserve at admission are not free (nor only cached). Read
        while the stepping thread may be stepping: an estimate, exact between steps."""
        if len(self.running) + len(self.waiting) >= self.parallel:
            return True
        if req.kept:
            return False
        need = sum(self._admission_need(r, 0) for r in [*self.waiting, req] if not r.kept)
        return need > self.kv.pool.free() + self.kv.pool.cached_only() - self.reserved()

    # -- cells on demand
    def reserved(self) -> int:
        return sum(r.budget for r in self.running)

    def _spare(self) -> int:
        """Free cells no request has reserved."""
        return self.kv.pool.free() - self.reserved()

    def _total(self, req: Request) -> int:
        """Cells a request holds at its end: its prompt and its reply but the last token (that
        one too when it is fed)."""
        return len(req.ask.prompt) + req.max_new - (0 if req.ask.feed_last else 1)

    def _admission_need(self, req: Request, reused: int) -> int:
        """Cells admission reserves for a request whose first `reused` tokens are cached: its
        feed and HEADROOM more; after a preemption everything to its end (it waits until that
        is free instead of being preempted again as soon as it is back)."""
        if req.preempted:
            return self._total(req) - reused
        return len(req.feed) - reused + min(HEADROOM, self._total(req) - len(req.feed))

    def _grow(self) -> None:
        """Every decoding request (not kept: those reserved everything) gets a cell for its next
        token, claimed HEADROOM at a time, oldest request first; when the pool has none, room
        is made (`_make_room`)."""
        for req in sorted(self.running, key=lambda r: r.order):
            if req.kept or req.state not in DECODES or req.budget > 0 or req not in self.running:
                continue
            if self._make_room(req):
                req.granted(min(HEADROOM, self._total(req) - req.seq.n, self._spare()))

    def _make_room(self, req: Request) -> bool:
        """Until a cell is spare: cached prefixes that free one give way (least recently used
        first), then the youngest running request is preempted — `req` itself when it is the
        youngest (then False)."""
        while self._spare() < 1:
            if self.kv.evict_freeing():
                continue
            victim = max((r for r in self.running if not r.kept), key=lambda r: r.order)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Take a running request's cells back (vLLM's recompute): it goes to the front of the
        queue with its prompt and its reply so far to prefill, and resumes from their last
        token's logits as if it had decoded on (what it emitted stays emitted; its sampler's
        state is untouched). Never a closing one: only a kept sequence's request closes (feed_last),
        and those are never preempted."""
        self.counters.preempted += 1
        self.kv.release(req.seq)
        req.took_back()
        with self.cond:  # one move for `_would_wait`, which counts both lists
            self.running.remove(req)
            self.waiting.appendleft(req)

    # -- admission
    def _admit(self) -> None:
        with self.cond:
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                self._emit(req, req.finished("cancelled"))
            while self.waiting and len(self.running) < self.parallel:
                req = self.waiting[0]
                if not (self._admit_kept(req) if req.kept else self._admit_new(req)):
                    return  # it waits until running sequences free their cells
                self.waiting.popleft()
                self.running.append(req)
                if req.preempted:
                    continue  # counted when it first came in
                c = self.counters
                c.requests += 1
                c.prompt_tokens += len(req.ask.prompt)
                c.reused_tokens += req.reused

    def _admit_new(self, req: Request) -> bool:
        """A request gets a sequence of its own holding its tenant's longest cached prefix and
        reserves `_admission_need`, cached prefixes giving way; False when that is not free."""
        seq = self.kv.new()
        k = self.kv.attach_prefix(seq, req.feed[:-1], req.ask.tenant)  # the last token is always fed: its logits
        need = self._admission_need(req, k)
        while self._spare() < need and self.kv.evict_freeing():
            pass
        if self._spare() < need:
            self.kv.release(seq)
            return False
        req.admitted(seq, k, need)
        return True

    def _admit_kept(self, req: Request) -> bool:
        """A request appending to a kept sequence: its cells are the context, it reserves what it
        may add (a ring: what is free; it then overwrites its own oldest cells)."""
        seq = req.ask.seq
        if any(r.seq is seq for r in self.running):
            raise EdgeKVError("a held sequence runs one request at a time")
        # every prompt token is fed; of the sampled ones all but the last (feed_last: all)
        need = min(len(req.ask.prompt) + max(0, req.max_new - (0 if req.ask.feed_last else 1)), seq.room())
        free = self._spare()
        while free < need and self.kv.evict_one():
            free = self._spare()
        if seq.ring:
            need = max(0, min(need, free))
        elif free < need:
            return False
        req.admitted(seq, 0, need)
        return True

    # -- the step
    def schedule(self) -> list[Piece] | None:
        """Drop what was cancelled, give every decoding request its next cell (preempting when
        the pool runs out), admit what fits; the step's pieces (None: nothing runs)."""
        for req in [r for r in self.running if r.cancelled]:
            self.finish(req, "cancelled")
        self._grow()
        self._admit()
        if not self.running:
            return None
        pieces = [Piece(r, r.seq, [r.next_token], True, True) for r in self.running if r.state in DECODES]
        # prompt tokens ride along up to the chunk, within what one call takes (a TensorRT profile)
        budget = min(self.prefill_chunk, self.max_tokens_per_call - len(pieces))
        for r in self.running:
            left = len(r.feed) - r.fed
            if r.state is PREFILLING and left > 0 and budget > 0:
                take = min(budget, left)
                if r.seq.ring:  # a ring streams a longer prompt through its cells
                    take = min(take, self.kv.capacity - r.seq.sinks)
                end, lf = r.fed + take, r.ask.logits_from
                scored = 0 if lf is None else max(0, end - max(r.fed, lf))
                pieces.append(Piece(r, r.seq, r.feed[r.fed: end], False, end == len(r.feed), scored))
                budget -= take
        return pieces

    def wrote(self, call: Call, now: float) -> None:
        """A call's tokens are in cells: the requests' books follow; a prompt wholly in cells is cached."""
        if call.freed:
            call.pieces[0].req.granted(call.freed)
        for p in call.pieces:
            req = p.req
            req.wrote(len(p.tokens), p.decode, now)
            if not p.decode:
                self.counters.prefilled_tokens += len(p.tokens)
                if req.fed == len(req.feed) and not req.kept:
                    self.kv.remember_prompt(req.seq, req.feed, req.ask.tenant)

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        """End a running request: its own sequence's cells given back (a finished conversation's
        cached first: a client's next turn sends it back with its new message, and prefills only
        that), a kept one's kept; then its Done."""
        if not req.kept:
            keep = reason in ("stop", "length") and req.seq.n > len(req.ask.prompt)
            self.kv.release(req.seq, req.prompt + req.out if keep else None, req.ask.tenant)
        self.running.remove(req)
        self._emit(req, req.finished(reason, error))

    @staticmethod
    def _emit(req: Request, event) -> None:
        if req.ask.emit:
            req.ask.emit(event)
