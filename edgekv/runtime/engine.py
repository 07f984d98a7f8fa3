"""Engine: several sequences decoded together over one pool of KV cells (continuous batching).

The pool is one KVCache allocated once; a CellPool (pool.py) says which cells hold what. Each
`step` is one graph call (more only when the free cells are fragmented) with B = 1 and a batch
of S tokens drawn from every active sequence: the next token of each decoding sequence, then up
to `prefill_chunk` prompt tokens of those still prefilling, so a new request joins at the next
step and running streams never wait for a whole prompt. The past is the pool's cells
[0, high water); the mask [1, S, P + S] says per token which cells are its own sequence's and
which earlier tokens of the batch it sees. The new tokens' K/V land in a contiguous run of free
cells. A finished or cancelled sequence drops its cells at once; its prompt's cells stay in the
prefix cache for the next request that starts the same way.

Admission reserves every cell a request may need (prompt + max_tokens), so a running sequence
never runs out of cells; requests that do not fit wait in a bounded queue (`QueueFull` past it).
The engine's thread makes every graph call; callers submit and cancel from any thread and get
tokens through the request's `emit` callback (called on the engine thread)."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edgekv.errors import ContextOverflow, EdgeKVError, QueueFull, note
from edgekv.runtime.backends.base import PREFILL_CHUNK, BatchBackend
from edgekv.runtime.pool import CellPool
from edgekv.runtime.sampling import SamplingParams, sample


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_ids: set[int] = field(default_factory=set)
    emit: Callable[[str, object], None] | None = None  # ("token", id) then ("done", reason); engine thread
    record_logits: bool = False  # keep a copy of every sampled-from logits row (tests)
    # the engine's bookkeeping
    cells: list[int] = field(default_factory=list)  # cell of position i, in order
    fed: int = 0  # prompt tokens in cells
    reused: int = 0  # of which taken from the prefix cache
    out: list[int] = field(default_factory=list)
    next_token: int | None = None  # sampled, to be fed at the next step
    budget: int = 0  # cells it may still claim (reserved at admission)
    finish_reason: str | None = None
    cancelled: bool = False
    t_submit: float = 0.0
    ttft_s: float | None = None
    logits: list = field(default_factory=list)

    def __post_init__(self):
        self.rng = np.random.default_rng(self.params.seed)


class Engine:
    def __init__(self, runtime, capacity: int | None = None, parallel: int = 4, max_queue: int = 64,
                 prefill_chunk: int = PREFILL_CHUNK, max_prefixes: int = 32):
        self.backend = runtime.backend
        if not isinstance(self.backend, BatchBackend):
            raise EdgeKVError(f"serving needs a backend that runs a pool of cells (run_cells); {self.backend.name} "
                              "here runs one sequence per call")
        self.cache = runtime.cache(capacity)
        self.capacity = self.cache.capacity
        self.limit = min(self.capacity, self.cache.max_positions)  # cells and positions of one sequence
        self.pool = CellPool(self.capacity, max_prefixes)
        # every running sequence's next token goes into one call
        self.parallel, self.max_queue = min(parallel, self.backend.max_tokens_per_call), max_queue
        self.prefill_chunk = min(prefill_chunk, self.backend.max_tokens_per_call)
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self.cond = threading.Condition()
        self.counters = dict.fromkeys(("requests", "prompt_tokens", "reused_tokens", "prefilled_tokens",
                                       "generated_tokens", "steps", "calls"), 0)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._paused = False

    # -- from any thread
    def submit(self, req: Request) -> Request:
        """Queue a request (its max_tokens capped to the room left after its prompt)."""
        if not req.prompt:
            raise EdgeKVError("empty prompt: nothing to feed the model")
        if len(req.prompt) >= self.limit:
            raise ContextOverflow(f"the prompt has {len(req.prompt)} tokens; the context holds {self.limit} "
                                  f"(prompt and at least one new token)", setting="capacity", fix="raise {}")
        req.max_tokens = max(1, min(req.max_tokens, self.limit - len(req.prompt)))
        req.t_submit = time.perf_counter()
        with self.cond:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the wait queue is full ({self.max_queue} requests waiting)")
            self.waiting.append(req)
            self.cond.notify()
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request (a client gone); its cells are freed at the next step."""
        req.cancelled = True
        with self.cond:
            self.cond.notify()

    def stats(self) -> dict:
        with self.cond:
            waiting = len(self.waiting)
        return {**self.counters, "waiting": waiting, "active": len(self.active), "cells_used": self.pool.used(),
                "cells_free": self.pool.free(), "cells_cached_only": self.pool.cached_only(),
                "capacity": self.capacity, "reserved": self.reserved()}

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
                    self._finish(req, "error")

    def reserved(self) -> int:
        return sum(r.budget for r in self.active)

    def step(self) -> bool:
        """Admit what fits, drop what was cancelled, and run one batched step. False when idle."""
        self._admit()
        for req in [r for r in self.active if r.cancelled]:
            self._finish(req, "cancelled")
        if not self.active:
            return False
        pieces = [(r, [r.next_token], True) for r in self.active if r.next_token is not None]
        # prompt tokens ride along up to the chunk, within what one call takes (a TensorRT profile)
        budget = min(self.prefill_chunk, self.backend.max_tokens_per_call - len(pieces))
        for r in self.active:
            if r.fed < len(r.prompt) and budget > 0:
                take = min(budget, len(r.prompt) - r.fed)
                pieces.append((r, r.prompt[r.fed: r.fed + take], False))
                budget -= take
        self._place(deque(pieces))
        self.counters["steps"] += 1
        return True

    def _admit(self) -> None:
        with self.cond:
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                req.finish_reason = "cancelled"
                if req.emit:
                    req.emit("done", "cancelled")
            while self.waiting and len(self.active) < self.parallel:
                req = self.waiting[0]
                k, cells = self.pool.lookup(req.prompt[:-1])  # the last prompt token is always fed: its logits
                need = len(req.prompt) - k + req.max_tokens - 1
                self.pool.take(cells)  # held before any eviction below
                while self.pool.free() - self.reserved() < need and self.pool.evict_one():
                    pass
                if self.pool.free() - self.reserved() < need:
                    self.pool.drop(cells)
                    return  # it waits until running sequences free their cells
                # cached prefixes scattered over the pool would cut its prompt into many small
                # calls (each binding the whole past): give way until one chunk (with the running
                # sequences' next tokens, placed first) fits in one run, while that helps
                self._make_run(min(len(req.prompt) - k, self.prefill_chunk) + len(self.active))
                self.waiting.popleft()
                req.cells, req.fed, req.reused, req.budget = [int(c) for c in cells], k, k, need
                self.active.append(req)
                c = self.counters
                c["requests"] += 1
                c["prompt_tokens"] += len(req.prompt)
                c["reused_tokens"] += k

    def _make_run(self, want: int) -> None:
        """Evict cached prefixes, least recently used first, until `want` free cells lie in one
        run; none at all when even an empty cache would leave no such run (running sequences'
        cells fragment the pool: evicting would empty the cache for nothing)."""
        if self.pool.free_run(want)[1] >= want or self.pool.run_without_cache(want) < want:
            return
        while self.pool.free_run(want)[1] < want and self.pool.evict_one():
            pass

    def _place(self, pieces: deque) -> None:
        """Run the step's pieces in as few calls as the free runs of cells allow (one, unless
        the free cells are fragmented)."""
        while pieces:
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

    def _past(self) -> int:
        """Cells bound as the past: [0, high water) rounded up to the backend's bucket (ort), so
        the past binding changes once per bucket, not every step; the cells above the high water
        belong to no sequence and stay masked."""
        b = self.backend.past_bucket
        return min(-(-self.pool.high_water() // b) * b, self.capacity)

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
            pos[0, r: r + n] = len(req.cells) + np.arange(n)
            if req.cells:
                mask[0, r: r + n, req.cells] = True  # its own past, wherever its cells are
            mask[0, r: r + n, p + r: p + r + n] = np.tri(n, dtype=np.bool_)  # its new tokens, causally
            if dec or req.fed + n == len(req.prompt):
                rows.append(r + n - 1)  # the last token of a prompt, or a decode step: sample from it
            r += n
        idx = np.asarray([rows or [s - 1]], np.int64)
        logits = self.backend.run_cells(self.cache, p, w, ids, pos, mask, idx)
        self.pool.take(np.arange(w, w + s))
        self.counters["calls"] += 1
        r, j = 0, 0
        for req, toks, dec in call:
            n = len(toks)
            req.cells.extend(range(w + r, w + r + n))
            req.budget -= n
            r += n
            if dec:
                req.next_token = None
            else:
                req.fed += n
                self.counters["prefilled_tokens"] += n
                if req.fed == len(req.prompt):
                    self.pool.remember(req.prompt, np.asarray(req.cells[: req.fed]))
            if dec or req.fed == len(req.prompt):
                self._sample(req, logits[0, j])
                j += 1

    def _sample(self, req: Request, row: np.ndarray) -> None:
        if req.cancelled:
            return  # dropped at the next step
        if req.record_logits:
            req.logits.append(row.copy())
        history = (req.prompt + req.out)[-req.params.repeat_last_n:] if req.params.repeat_penalty != 1.0 else []
        tok = sample(row, req.params, req.rng, history)
        if req.ttft_s is None:
            req.ttft_s = time.perf_counter() - req.t_submit
        if tok in req.stop_ids:
            self._finish(req, "stop")
            return
        req.out.append(tok)
        self.counters["generated_tokens"] += 1
        if req.emit:
            req.emit("token", tok)
        if len(req.out) >= req.max_tokens:
            self._finish(req, "length")
        else:
            req.next_token = tok

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if reason in ("stop", "length") and len(req.cells) > len(req.prompt):
            # the whole conversation so far (prompt and the reply tokens that were fed): a client's
            # next turn sends it back with its new message, and prefills only that
            self.pool.remember((req.prompt + req.out)[: len(req.cells)], np.asarray(req.cells))
        self.pool.drop(req.cells)
        req.cells, req.budget, req.next_token = [], 0, None
        self.active.remove(req)
        if req.emit:
            req.emit("done", reason)
