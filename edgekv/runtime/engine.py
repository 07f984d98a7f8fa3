"""Engine: several sequences decoded together over one pool of KV cells (continuous batching).

The pool is one KVCache allocated once; a CellPool (pool.py) says which cells hold what. Each
`step` is one graph call with B = 1 and a batch of S tokens drawn from every active sequence:
the next token of each decoding sequence, then up to `prefill_chunk` prompt tokens of those
still prefilling, so a new request joins at the next step and running streams never wait for a
whole prompt. Before a step the pool is compacted where that helps (`_tidy`): the running
sequences' cells low, the cells only the prefix cache holds at the top, the free cells one run
between. The past is cells [0, the highest a running sequence holds); the mask [1, S, P + S]
says per token which cells are its own sequence's and which earlier tokens of the batch it
sees. The new tokens' K/V land in a contiguous run of free cells (in a chat turn, which does
not compact, a step may be split over several runs). A finished or cancelled sequence drops its cells at once; its prompt's cells stay in the
prefix cache for the next request that starts the same way.

Cells are reserved on demand: admission reserves a request's prompt and a small headroom, a
decoding request claims more as it goes, and when the pool runs out the youngest running request
is preempted (its cells freed, its prompt and reply so far prefilled again when it is readmitted:
vLLM's recompute), so one request's large max_tokens does not hold the pool for the others.
Requests that cannot start wait in a bounded queue (`QueueFull` past it).
The engine's thread makes every graph call; callers submit and cancel from any thread and get
tokens through the request's `emit` callback (called on the engine thread).

Chat runs on the same engine without its thread (`run`): its conversation is a `Held` sequence
whose cells stay in the pool between requests, each turn a request that appends to it. A held
ring (StreamingLLM) overwrites its own oldest cells after the sinks when the pool is full; a
turn (`begin_turn`) can be rolled back exactly, the cells it overwrote included."""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edgekv.errors import ContextOverflow, EdgeKVError, QueueFull, note
from edgekv.runtime.backends.base import PREFILL_CHUNK, BatchBackend, bound_past
from edgekv.runtime.cache import KVCache, runs
from edgekv.runtime.pool import CellPool
from edgekv.runtime.sampling import SamplingParams, sample
from edgekv.runtime.sequence import NO_LIMIT, FedTokens

NON_FINITE = ("the model produced non-finite logits (NaN or infinity); the bundle's weights may be damaged: "
              "check them with `edgekv verify BUNDLE`")
# cells a request reserves beyond its prompt at admission, and claims at a time while it decodes:
# enough that a new request does not preempt at once, small beside a pool (docs/serve.md)
HEADROOM = 16
# steps in a row that failed every request they sampled (non-finite logits) or raised: the engine
# is failing everything (`Engine.fault`); one good row resets it
FAULT_STEPS = 3


class NonFinite(EdgeKVError):
    pass


class Held(FedTokens):
    """A sequence whose cells stay in the engine's pool between requests: a chat conversation.
    Its cells and ids are written by the engine only (the methods marked so); its owner chooses
    the ring (`enable_ring` / `disable_ring`, on an empty sequence); everyone else reads it.

    `cells` are the cells of the tokens in context, in position order; `ids` every token fed
    since the last reset (a ring's overwritten ones too), so the next position is len(ids). A
    ring keeps its first `sinks` cells forever and overwrites the oldest of the rest."""

    def __init__(self, capacity: int, max_positions: int):
        super().__init__(capacity, max_positions)  # capacity: the pool's cells
        self._cells: list[int] = []

    # -- what it holds (read-only)
    @property
    def n(self) -> int:
        return len(self._cells)

    @property
    def pos(self) -> int:
        return len(self._ids)

    @property
    def cells(self) -> list[int]:
        return list(self._cells)

    @property
    def wrapped(self) -> bool:
        """A ring that has overwritten tokens (its cells no longer hold every id)."""
        return len(self._ids) > len(self._cells)

    def room(self) -> int:
        """Tokens it may still be fed: free cells (a ring always has some) and verified positions."""
        cells = NO_LIMIT if self.ring else self.capacity - self.n
        return min(cells, self.max_positions - self.pos)

    def check_restore(self, n: int, ids: list[int]) -> None:
        """`Engine.restore` would accept n cells holding the last n of `ids` (an error saying why not)."""
        self._check_capacity(n)
        if len(ids) < n or (len(ids) > n and not self.ring):
            raise EdgeKVError(f"snapshot holds {n} slots but {len(ids)} token ids"
                              + (" (a wrapped ring: load it with the ring policy)" if len(ids) > n else ""))
        self._check_positions(ids)

    # -- the engine's
    def _set(self, cells: list[int], ids: list[int]) -> None:
        self._cells, self._ids = list(cells), list(ids)

    def _state(self) -> tuple:
        return list(self._cells), list(self._ids), self._sinks

    def _restore_state(self, state: tuple) -> None:
        cells, ids, self._sinks = state
        self._cells, self._ids = list(cells), list(ids)


class Health:
    """Whether the engine is failing everything: the last FAULT_STEPS steps each raised or had
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
            self.failed_steps, self.reason = self.failed_steps + 1, error or NON_FINITE
        self.good = self.bad = 0

    def fault(self) -> str | None:
        n = self.failed_steps
        return f"the last {n} engine steps failed every request in them: {self.reason}" if n >= FAULT_STEPS else None


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int  # the caller's; the engine's cap of it is max_new
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: set[int] = field(default_factory=set)
    emit: Callable[[str, object], None] | None = None  # ("token", id) then ("done", reason); engine thread
    record_logits: bool = False  # keep a copy of every sampled-from logits row (tests)
    held: Held | None = None  # append to this sequence (its cells are the context; the prompt is only what is new)
    feed_last: bool = False  # feed the last token (a stop token too) so the held cells hold the whole turn
    rng: np.random.Generator | None = None  # default: one seeded with params.seed
    tenant: str = ""  # whose prompt it is (an API key's id): prefixes are reused only within a tenant
    # the engine's bookkeeping
    feed: list[int] = field(default_factory=list)  # to prefill: the prompt (after a preemption, and the reply so far)
    max_new: int = 0  # max_tokens capped to the room left after the prompt
    order: int = 0  # arrival number: the youngest running request is preempted first
    preempted: int = 0  # times its cells were taken back (it then prefilled again)
    error: str | None = None  # why it ended with finish reason "error" (one line)
    cells: list[int] = field(default_factory=list)  # cells of the tokens in context, in position order
    pos: int = 0  # the next token's position
    fed_ids: list[int] = field(default_factory=list)  # every token fed, in order
    fed: int = 0  # tokens of feed in cells
    reused: int = 0  # of which taken from the prefix cache
    out: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, to be fed at the next step
    budget: int = 0  # cells reserved for it and not yet written (admission, then HEADROOM at a time)
    finish_reason: str | None = None
    cancelled: bool = False
    limit_reason: str = "length"  # why it ends at max_tokens ("context": capped to the room left)
    closing: str | None = None  # finished, its last token still to be fed (feed_last)
    t_submit: float = 0.0
    ttft_s: float | None = None
    t_last: float = 0.0  # when its last decode call (one sampled from) returned
    decode_steps: int = 0  # decode calls sampled from, after the first token
    logits: list = field(default_factory=list)

    def __post_init__(self):
        if self.rng is None:
            self.rng = np.random.default_rng(self.params.seed)


class Engine:
    def __init__(self, backend, cache: KVCache, parallel: int = 4, max_queue: int = 64,
                 prefill_chunk: int = PREFILL_CHUNK, max_prefixes: int = 32):
        if not isinstance(backend, BatchBackend):
            raise EdgeKVError(f"the engine (serve, chat) needs a backend that runs a pool of cells (run_cells); "
                              f"{backend.name} here runs one sequence per call")
        self.backend, self.cache = backend, cache
        self.capacity = self.cache.capacity
        self.limit = min(self.capacity, self.cache.max_positions)  # cells and positions of one sequence
        self.pool = CellPool(self.capacity, max_prefixes)
        # every running sequence's next token goes into one call
        self.parallel, self.max_queue = min(parallel, self.backend.max_tokens_per_call), max_queue
        self.prefill_chunk = min(prefill_chunk, self.backend.max_tokens_per_call)
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self.held: list[Held] = []
        self.cond = threading.Condition()
        self.counters = dict.fromkeys(("requests", "prompt_tokens", "reused_tokens", "prefilled_tokens",
                                       "generated_tokens", "steps", "calls", "moved_cells", "preempted"), 0)
        self.counters["compaction_seconds"] = 0.0
        self._thread: threading.Thread | None = None
        self._stop = False
        self._paused = False
        self._turn: Turn | None = None
        self._arrivals = 0
        self.health = Health()

    # -- from any thread
    def submit(self, req: Request) -> Request:
        """Queue a request (it may generate max_tokens capped to the room left after its prompt).
        QueueFull when it could not start at the next step and `max_queue` requests wait already
        (`max_queue` 0: nothing waits, a request that can start now still starts)."""
        if not req.prompt:
            raise EdgeKVError("empty prompt: nothing to feed the model")
        req.feed, req.max_new, req.limit_reason = list(req.prompt), req.max_tokens, "length"
        if req.held is None:
            if len(req.prompt) >= self.limit:
                raise ContextOverflow(f"the prompt has {len(req.prompt)} tokens; the context holds {self.limit} "
                                      f"(prompt and at least one new token)", setting="capacity", fix="raise {}")
            req.max_new = max(1, min(req.max_tokens, self.limit - len(req.prompt)))
        else:
            room = req.held.room()
            if len(req.prompt) > room:
                raise ContextOverflow(f"context full: {len(req.prompt)} more tokens, room for {room} (cells, and "
                                      f"positions of the {self.cache.max_positions} verified)", setting="capacity",
                                      fix="raise {}")
            # the last sampled token needs no room when it is not fed (a reply cut at the context's end)
            cap = room - len(req.prompt) + 1
            if req.max_new > cap:
                req.max_new, req.limit_reason = cap, "context"
        req.t_submit = time.perf_counter()
        with self.cond:
            if self._queued_behind() >= self.max_queue and self._would_wait(req):
                raise QueueFull(f"the wait queue is full ({self.max_queue} requests may wait)")
            self._arrivals += 1
            req.order = self._arrivals
            self.waiting.append(req)
            self.cond.notify()
        return req

    def _queued_behind(self) -> int:
        """Waiting requests beyond the slots the next step admits into (with self.cond held)."""
        return max(0, len(self.waiting) - max(0, self.parallel - len(self.active)))

    def _would_wait(self, req: Request) -> bool:
        """`req` would not start at the next step: no slot left for it, or the cells the
        requests before it and it reserve at admission are not free (nor only cached). Read
        while the engine thread may be stepping: an estimate, exact between steps."""
        if len(self.active) + len(self.waiting) >= self.parallel:
            return True
        if req.held is not None:
            return False
        need = sum(self._admission_need(r, 0) for r in [*self.waiting, req] if r.held is None)
        return need > self.pool.free() + self.pool.cached_only() - self.reserved()

    def fault(self) -> str | None:
        """None while the engine works; a one-line reason while it fails every request (the
        last FAULT_STEPS steps raised or gave only non-finite logits: damaged weights)."""
        return self.health.fault()

    def cancel(self, req: Request) -> None:
        """Stop a request (a client gone); its cells are freed at the next step."""
        req.cancelled = True
        with self.cond:
            self.cond.notify()

    def stats(self) -> dict:
        with self.cond:
            waiting = len(self.waiting)
        # read without a lock while the engine thread steps: gauges, not a snapshot (used + free
        # = capacity holds: one read)
        used = self.pool.used()
        return {**self.counters, "waiting": waiting, "active": len(self.active), "cells_used": used,
                "cells_free": self.capacity - used, "cells_cached_only": self.pool.cached_only(),
                "cells_bound": self._past(), "capacity": self.capacity, "reserved": self.reserved()}

    # -- the engine thread
    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="edgekv-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify()
        if self._thread:
            self._thread.join(timeout=30)

    def pause(self, paused: bool = True) -> None:
        """Hold the engine thread between steps (requests still queue), or let it go on."""
        with self.cond:
            self._paused = paused
            self.cond.notify()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self._stop and (self._paused or not (self.waiting or self.active)):
                    self.cond.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception as e:  # one bad step must not kill the server: fail what was running
                note(f"engine: step failed: {type(e).__name__}: {e}")
                for req in list(self.active):
                    req.error = f"the engine step failed: {type(e).__name__}: {e}"
                    self._finish(req, "error")

    def reserved(self) -> int:
        return sum(r.budget for r in self.active)

    def step(self) -> bool:
        """Drop what was cancelled, give every decoding request its next cell (preempting when
        the pool runs out), admit what fits, and run one batched step. False when idle."""
        try:
            ran = self._step()
        except Exception as e:
            self.health.step_ended(f"{type(e).__name__}: {e}")
            raise
        self.health.step_ended()
        return ran

    def _step(self) -> bool:
        for req in [r for r in self.active if r.cancelled]:
            self._finish(req, "cancelled")
        self._grow()
        self._admit()
        if not self.active:
            return False
        pieces = [(r, [r.next_token], True) for r in self.active if r.next_token is not None]
        # prompt tokens ride along up to the chunk, within what one call takes (a TensorRT profile)
        budget = min(self.prefill_chunk, self.backend.max_tokens_per_call - len(pieces))
        for r in self.active:
            if r.fed < len(r.feed) and budget > 0:
                take = min(budget, len(r.feed) - r.fed)
                if r.held is not None and r.held.ring:  # a ring streams a longer prompt through its cells
                    take = min(take, self.capacity - r.held.sinks)
                pieces.append((r, r.feed[r.fed: r.fed + take], False))
                budget -= take
        self._tidy(sum(len(t) for _, t, _ in pieces))
        self._place(deque(pieces))
        self.counters["steps"] += 1
        return True

    # -- cells on demand
    def _spare(self) -> int:
        """Free cells no request has reserved."""
        return self.pool.free() - self.reserved()

    def _total(self, req: Request) -> int:
        """Cells a request (not held) holds at its end: its prompt and its reply but the last
        token (that one too when it is fed)."""
        return len(req.prompt) + req.max_new - (0 if req.feed_last else 1)

    def _admission_need(self, req: Request, reused: int) -> int:
        """Cells admission reserves for a request (not held) whose first `reused` tokens are
        cached: its feed and HEADROOM more; after a preemption everything to its end (it waits
        until that is free instead of being preempted again as soon as it is back)."""
        if req.preempted:
            return self._total(req) - reused
        return len(req.feed) - reused + min(HEADROOM, self._total(req) - len(req.feed))

    def _grow(self) -> None:
        """Every decoding request (not held: those reserved everything) gets a cell for its next
        token, claimed HEADROOM at a time, oldest request first; when the pool has none, room
        is made (`_make_room`)."""
        for req in sorted(self.active, key=lambda r: r.order):
            if req.held is not None or req.next_token is None or req.budget > 0 or req not in self.active:
                continue
            if self._make_room(req):
                req.budget = min(HEADROOM, self._total(req) - len(req.cells), self._spare())

    def _make_room(self, req: Request) -> bool:
        """Until a cell is spare: cached prefixes that free one give way (least recently used
        first), then the youngest running request is preempted — `req` itself when it is the
        youngest (then False)."""
        while self._spare() < 1:
            if self.pool.evict_freeing():
                continue
            victim = max((r for r in self.active if r.held is None), key=lambda r: r.order)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Take a running request's cells back (vLLM's recompute): it goes to the front of the
        queue with its prompt and its reply so far to prefill, and resumes from their last
        token's logits as if it had decoded on (what it emitted stays emitted; its sampler's
        state is untouched). One that only had its last token left to feed just ends."""
        self.counters["preempted"] += 1
        if req.closing:
            self._finish(req, req.closing)
            return
        self.pool.drop(req.cells)
        req.feed = req.prompt + req.out
        req.cells, req.fed_ids, req.fed, req.pos, req.budget, req.next_token = [], [], 0, 0, 0, None
        req.preempted += 1
        with self.cond:  # one move for `_would_wait`, which counts both lists
            self.active.remove(req)
            self.waiting.appendleft(req)

    def _admit(self) -> None:
        with self.cond:
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                req.finish_reason = "cancelled"
                if req.emit:
                    req.emit("done", "cancelled")
            while self.waiting and len(self.active) < self.parallel:
                req = self.waiting[0]
                if req.held is not None:
                    if not self._admit_held(req):
                        return
                elif not self._admit_one(req):
                    return  # it waits until running sequences free their cells
                self.waiting.popleft()
                self.active.append(req)
                if req.preempted:
                    continue  # counted when it first came in
                c = self.counters
                c["requests"] += 1
                c["prompt_tokens"] += len(req.prompt)
                c["reused_tokens"] += req.reused

    def _admit_one(self, req: Request) -> bool:
        """A request (not held) takes the cells of its tenant's longest cached prefix and reserves
        `_admission_need`, cached prefixes giving way; False when that is not free."""
        k, cells = self.pool.lookup(req.feed[:-1], req.tenant)  # the last token is always fed: its logits
        need = self._admission_need(req, k)
        self.pool.take(cells)  # held before any eviction below
        while self._spare() < need and self.pool.evict_freeing():
            pass
        if self._spare() < need:
            self.pool.drop(cells)
            return False
        req.cells, req.fed, req.budget, req.pos = [int(c) for c in cells], k, need, k
        if not req.preempted:  # cached tokens of its own prompt, not of its first admission's work
            req.reused = k
        return True

    def _admit_held(self, req: Request) -> bool:
        """A request appending to a held sequence: its cells are the context, it reserves what it
        may add (a ring: what is free; it then overwrites its own oldest cells)."""
        h = req.held
        if any(r.held is h for r in self.active):
            raise EdgeKVError("a held sequence runs one request at a time")
        # every prompt token is fed; of the sampled ones all but the last (feed_last: all)
        need = min(len(req.prompt) + max(0, req.max_new - (0 if req.feed_last else 1)), h.room())
        free = self.pool.free() - self.reserved()
        while free < need and self.pool.evict_one():
            free = self.pool.free() - self.reserved()
        if h.ring:
            need = max(0, min(need, free))
        elif free < need:
            return False
        req.cells, req.fed, req.reused, req.budget, req.pos = h.cells, 0, 0, need, h.pos
        return True

    def _place(self, pieces: deque) -> None:
        """Run the step's pieces in as few calls as the free runs of cells allow (one, unless
        the free cells are fragmented: only in a chat turn, which does not compact). A held ring short of free cells first gives up its
        oldest tokens after the sinks, as many as the piece lacks."""
        while pieces:
            req, toks, _ = pieces[0]
            if req.held is not None and req.held.ring and self.pool.free() < len(toks):
                self._overwrite_oldest(req, len(toks) - self.pool.free())
            total = sum(len(t) for _, t, _ in pieces)
            start, length = self.pool.free_run(total)
            if length == 0:
                raise RuntimeError("no free cell although every request's cells were reserved")
            call = []
            while pieces and length > 0:
                req, toks, dec = pieces[0]
                if len(toks) <= length:
                    call.append(pieces.popleft())
                    length -= len(toks)
                else:  # the rest of this prompt piece goes to the next call
                    call.append((req, toks[:length], dec))
                    pieces[0] = (req, toks[length:], dec)
                    length = 0
            self._call(start, call)

    def _overwrite_oldest(self, req: Request, count: int) -> None:
        """Free a ring's `count` oldest cells after its sinks: those tokens leave the context
        now, before the call that overwrites them (which cells they are does not matter: what a
        token sees is set by the mask, so a ring behaves the same in any layout of its cells)."""
        sinks = req.held.sinks
        if sinks + count > len(req.cells):
            raise EdgeKVError("ring cache: no cell left to overwrite beside the sinks")
        gone = req.cells[sinks: sinks + count]
        del req.cells[sinks: sinks + count]
        self.pool.drop(gone)
        req.budget += count

    def _past(self) -> int:
        """Cells bound as the past: up to the highest cell a sequence holds, rounded up to the
        backend's bucket (ort), so the binding changes once per bucket, not every step; free and
        cached cells inside it stay masked, cached ones above it cost the call nothing."""
        return self._bucket(self.pool.live_high_water())

    def _bucket(self, n: int) -> int:
        return bound_past(n, self.backend.past_bucket, self.capacity)

    def _tidy(self, want: int) -> None:
        """Compact the pool before a step when the past, now or once the step's `want` new cells
        are written where they would land, runs beyond what the sequences' cells need (rounded
        to the bucket), or when those cells would not lie in one free run (several calls, each
        reading all the weights). Not for chat (held sequences, turns: a rollback restores
        owners, not moved cells): one conversation's pool fragments only where its ring overwrites."""
        if self._turn is not None or self.held:
            return
        pool = self.pool
        start, length = pool.free_run(want)
        reach = max(pool.live_high_water(), start + length)
        if self._bucket(reach) > self._bucket(int(pool.live().sum()) + want) or length < min(want, pool.free()):
            self._compact()

    def _compact(self) -> None:
        """Move cells to the pool's compaction layout (their K/V rows copied) and rename every
        owner's cells: the pool's and the running requests' (chat's held sequences never move)."""
        assert self._turn is None and not self.held, "compaction would leave a turn or a held sequence stale"
        perm, moved = self.pool.compaction()
        if not moved.size:
            return
        t0 = time.perf_counter()
        try:
            self.cache.move_cells(moved, perm[moved])
        except BaseException:  # rows half moved: neither a cached prefix nor a running request can be trusted
            while self.pool.evict_one():
                pass
            for req in list(self.active):
                self._finish(req, "error")
            raise
        self.pool.relabel(perm)
        for req in self.active:
            req.cells = perm[req.cells].tolist() if req.cells else []
        self.counters["moved_cells"] += int(moved.size)
        self.counters["compaction_seconds"] += time.perf_counter() - t0

    def _call(self, w: int, call: list) -> None:
        s = sum(len(t) for _, t, _ in call)
        p = self._past()
        ids = np.empty((1, s), np.int64)
        pos = np.empty((1, s), np.int64)
        mask = np.zeros((1, s, p + s), np.bool_)
        rows, r = [], 0
        for req, toks, dec in call:
            n = len(toks)
            ids[0, r: r + n] = toks
            pos[0, r: r + n] = req.pos + np.arange(n)
            if req.cells:
                mask[0, r: r + n, req.cells] = True  # its own past, wherever its cells are
            mask[0, r: r + n, p + r: p + r + n] = np.tri(n, dtype=np.bool_)  # its new tokens, causally
            if dec or req.fed + n == len(req.feed):
                rows.append(r + n - 1)  # the last token of a prompt, or a decode step: sample from it
            r += n
        idx = np.asarray([rows or [s - 1]], np.int64)
        self._protect(w, s)
        logits = self.backend.run_cells(self.cache, p, w, ids, pos, mask, idx)
        self.pool.take(np.arange(w, w + s))
        self.counters["calls"] += 1
        now = time.perf_counter()
        r, j = 0, 0
        for req, toks, dec in call:
            n = len(toks)
            req.cells.extend(range(w + r, w + r + n))
            req.fed_ids.extend(toks)
            req.pos += n
            req.budget -= n
            assert req.budget >= 0, "a request wrote more cells than it had reserved"
            r += n
            if dec:
                req.next_token = None
                if not req.closing:
                    req.decode_steps += 1
                    req.t_last = now
            else:
                req.fed += n
                self.counters["prefilled_tokens"] += n
                if req.fed == len(req.feed) and req.held is None:
                    self.pool.remember(req.feed, np.asarray(req.cells[: req.fed]), req.tenant)
            if dec or req.fed == len(req.feed):
                try:
                    self._after_row(req, logits[0, j])
                except Exception as e:
                    if req.held is not None:  # chat: the turn is rolled back
                        raise
                    self._fail(req, e)
                j += 1

    def _after_row(self, req: Request, row: np.ndarray) -> None:
        if req.closing:  # its last token is in the cells now
            self._finish(req, req.closing)
        elif req.max_new == 0:  # only fed (a held prompt)
            self._finish(req, "length")
        else:
            self._sample(req, row)

    def _fail(self, req: Request, e: Exception) -> None:
        """One request's sampling or stop handling raised: it alone ends, finish reason "error"
        (one that had ended already, its emit raising inside `_finish`, keeps its reason)."""
        note(f"engine: a request failed: {type(e).__name__}: {e}")
        if req not in self.active:
            return
        req.error = f"{type(e).__name__}: {e}"
        try:
            self._finish(req, "error")
        except Exception as again:  # its emit is broken: it has left all the same
            note(f"engine: a request's emit failed: {type(again).__name__}: {again}")

    def _can_feed(self, req: Request) -> bool:
        """One more token of this request fits: a cell (a ring overwrites) and a verified position."""
        ring = req.held is not None and req.held.ring
        return req.pos < self.cache.max_positions and (ring or len(req.cells) < self.capacity)

    def _sample(self, req: Request, row: np.ndarray) -> None:
        if req.cancelled:
            return  # dropped at the next step
        finite = bool(np.isfinite(row).all())
        self.health.row(finite)
        if not finite:  # damaged weights or an overflow: never sample from it
            if req.held is not None:  # chat: the turn is rolled back
                raise NonFinite(NON_FINITE)
            note(f"engine: {NON_FINITE}")
            req.error = NON_FINITE
            self._finish(req, "error")
            return
        if req.record_logits:
            req.logits.append(row.copy())
        history = []
        if req.params.repeat_penalty != 1.0:
            before = req.held.recent(req.params.repeat_last_n) if req.held is not None else []
            fed = req.fed_ids if req.held is not None else req.prompt + req.out  # what the cells hold
            history = (before + fed)[-req.params.repeat_last_n:]
        tok = sample(row, req.params, req.rng, history)
        if req.ttft_s is None:
            req.ttft_s = time.perf_counter() - req.t_submit
        reason = None
        if tok in req.stop_ids:
            reason = "stop"
        else:
            req.out.append(tok)
            self.counters["generated_tokens"] += 1
            if req.emit:
                req.emit("token", tok)
            if len(req.out) >= req.max_new:
                reason = req.limit_reason
        if reason is None:
            req.next_token = tok
        elif req.feed_last and self._can_feed(req):
            req.next_token, req.closing = tok, reason  # fed at the next step, then it ends
        else:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req.held is not None:  # its cells stay: the held sequence's context
            h = req.held
            h._set(req.cells, h.ids + req.fed_ids)
        else:
            if reason in ("stop", "length") and len(req.cells) > len(req.prompt):
                # the whole conversation so far (prompt and the reply tokens that were fed): a client's
                # next turn sends it back with its new message, and prefills only that
                self.pool.remember((req.prompt + req.out)[: len(req.cells)], np.asarray(req.cells), req.tenant)
            self.pool.drop(req.cells)
        req.cells, req.budget, req.next_token = [], 0, None
        self.active.remove(req)
        if req.emit:
            req.emit("done", reason)

    # -- held sequences (chat): one caller thread, no engine thread
    def hold(self) -> Held:
        """A new, empty sequence whose cells stay in the pool between its requests."""
        h = Held(self.limit, self.cache.max_positions)
        self.held.append(h)
        return h

    def release(self, h: Held) -> None:
        """Give a held sequence's cells back to the pool; it is no longer the engine's."""
        self.reset(h)
        self.held.remove(h)

    def run(self, req: Request) -> Request:
        """Submit `req` and step on the calling thread until it ends. Anything that stops it
        half-way (Ctrl-C, an error) undoes it whole (inside a turn: the turn's rollback)."""
        if self._thread is not None:
            raise RuntimeError("run() steps on the caller's thread; this engine has its own")
        with self._transaction():
            self.submit(req)
            while req.finish_reason is None:
                if not self.step():
                    raise ContextOverflow("the request does not fit in the free cells of the pool",
                                          setting="capacity", fix="raise {}")
        return req

    def truncate(self, h: Held, n: int) -> None:
        """Forget everything of `h` after its first n tokens (undo / regenerate)."""
        self._check_idle(h)
        if not 0 <= n <= h.n or h.wrapped:
            raise ValueError(f"cannot truncate a sequence of {h.n} tokens to {n}"
                             + (" (the ring has wrapped)" if h.wrapped else ""))
        cells = h.cells
        self.pool.drop(cells[n:])
        h._set(cells[:n], h.ids[:n])

    def reset(self, h: Held) -> None:
        """Forget everything `h` holds."""
        self._check_idle(h)
        self.pool.drop(h.cells)
        h._set([], [])

    def snapshot(self, h: Held) -> dict[str, np.ndarray]:
        """Host copies of `h`'s cells, in position order (slot i of the snapshot: its i-th token in context)."""
        return self.cache.read_cells(h.cells)

    def restore(self, h: Held, snap: dict[str, np.ndarray], ids: list[int], w: int | None = None,
                sinks: int | None = None) -> None:
        """Replace what `h` holds with a snapshot, the token ids it was fed and, for a ring, its
        sinks. `w`: the write slot of a wrapped ring saved in slot order (its oldest token at
        slot w, after the sinks): its slots are put in position order. All or nothing."""
        self._check_idle(h)
        n = self.cache.slots_in(snap)
        with self._transaction():
            self.reset(h)
            if h.ring:
                h.enable_ring(h.sinks if sinks is None else sinks)
            h.check_restore(n, ids)
            if w is not None and w != n:
                if not h.ring or not h.sinks <= w < n:
                    raise EdgeKVError("snapshot of a wrapped ring does not fit this cache")
                order = np.r_[0: h.sinks, w: n, h.sinks: w]
                snap = {k: v[order] for k, v in snap.items()}
            free = np.flatnonzero(self.pool.refs == 0)
            if free.size < n:
                raise ContextOverflow(f"snapshot holds {n} tokens, {free.size} cells are free", setting="capacity",
                                      fix="raise {}")
            cells = [int(c) for c in free[:n]]
            self.pool.take(cells)
            for a, b in runs(np.asarray(cells)):
                self._protect(a, b - a)
            self.cache.write_cells(cells, snap)
            h._set(cells, ids)

    def _check_idle(self, h: Held) -> None:
        if any(r.held is h for r in self.active) or any(r.held is h for r in self.waiting):
            raise EdgeKVError("a held sequence changes only between its requests")

    # -- turns: what a turn changes can be undone exactly (an interrupted or failed chat turn)
    def begin_turn(self) -> None:
        """Remember the pool and the held sequences now; `rollback` returns to this, the
        contents of cells it overwrote included (copied before each is first written)."""
        self._turn = Turn(self.pool.state(), [(h, h._state()) for h in self.held], self.capacity)

    def end_turn(self) -> None:
        self._turn = None

    def rollback(self) -> None:
        """Back to `begin_turn`: running and waiting requests dropped, the cells' owners, the
        held sequences and every overwritten cell as they were."""
        turn, self._turn = self._turn, None
        if turn is None:
            return
        with self.cond:
            self.waiting.clear()
        self.active.clear()
        if turn.whole is not None:
            self.cache.write(turn.whole)
        for start, rows in turn.rows:
            self.cache.write_rows(start, rows)
        self.pool.set_state(turn.pool)
        for h, state in turn.held:
            h._restore_state(state)

    @contextmanager
    def _transaction(self):
        """A turn around the block, unless one is open already (then that one undoes it)."""
        if self._turn is not None:
            yield
            return
        self.begin_turn()
        try:
            yield
        except BaseException:
            self.rollback()
            raise
        self.end_turn()

    def _protect(self, w: int, s: int) -> None:
        """Before a call writes cells [w, w + s): copy those in use at the turn's start, once
        each (where the memory reads row ranges; else the whole cache once)."""
        turn = self._turn
        if turn is None or turn.whole is not None:
            return
        todo = (turn.pool.refs[w: w + s] > 0) & ~turn.saved[w: w + s]
        if not todo.any():
            return
        if not self.cache.reads_rows:
            turn.whole = self.cache.read(self.capacity)
            return
        for a, b in runs(w + np.flatnonzero(todo)):
            turn.rows.append((a, self.cache.read_rows(a, b)))
        turn.saved[w: w + s] |= todo


class Turn:
    """What `Engine.rollback` restores: the pool's owners, the held sequences, and the rows of
    cells written since (copied before their first write)."""

    def __init__(self, pool: tuple, held: list, capacity: int):
        self.pool, self.held = pool, held
        self.rows: list[tuple[int, dict]] = []
        self.whole: dict | None = None  # the whole cache, where the memory cannot copy row ranges
        self.saved = np.zeros(capacity, np.bool_)
