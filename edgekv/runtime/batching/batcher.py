"""Batcher: several sequences decoded together over one pool of KV cells (continuous batching).

A step is nano-vllm's: the scheduler plans (scheduler.py), the KV manager places the plan's
tokens in cells (kv.py), the step runner runs each call (runner.py), the post-processing turns
the rows into tokens (postprocess.py). Serve runs it on its own thread (`start`): callers submit
and cancel from any thread and get events through the request's `emit` (on that thread). Chat
runs it on the caller's thread (`run`): its conversation is a kept sequence (`hold`) whose cells
stay in the pool between requests, each turn a request that appends to it, inside `turn()`,
which undoes it exactly when it fails or is interrupted."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import asdict

import numpy as np

from edgekv.errors import ContextOverflow, EdgeKVError, note
from edgekv.runtime.backends.base import PREFILL_CHUNK, Backend
from edgekv.runtime.batching import snapshot
from edgekv.runtime.batching.layouts import KV_LAYOUTS, MAX_PREFIXES, cell_pool
from edgekv.runtime.batching.poolseq import PoolSequence
from edgekv.runtime.batching.postprocess import Health, PostProcess
from edgekv.runtime.batching.request import DONE, Request, now
from edgekv.runtime.batching.scheduler import Scheduler
from edgekv.runtime.batching.window_rings import split_window
from edgekv.runtime.cache import KVCache


class Batcher:
    def __init__(self, backend, cache: KVCache, parallel: int = 4, max_queue: int = 64,
                 prefill_chunk: int = PREFILL_CHUNK, max_prefixes: int = MAX_PREFIXES):
        if not isinstance(backend, Backend):
            raise EdgeKVError(f"the batcher needs a backend that runs a pool of cells (run_cells); "
                              f"{getattr(backend, 'name', type(backend).__name__)} lacks a member of the Backend protocol")
        self.backend, self.cache = backend, cache
        per_call = backend.max_tokens_per_call
        self.kv, self.runner = KV_LAYOUTS.get(cache.layout, cell_pool)(backend, cache, max_prefixes)
        # every running sequence's next token goes into one call (and has a place: fused slots hold K)
        self.scheduler = Scheduler(self.kv, min(parallel, per_call, self.kv.max_sequences), max_queue,
                                   min(prefill_chunk, per_call), per_call)
        self.health = Health()
        # masks made while the graph runs pay where the run leaves the CPU free (a GPU); on the
        # CPU the backend's threads hold the cores and the worker only waits (docs/structured.md)
        self.post = PostProcess(self.scheduler, self.health, overlap_masks=getattr(backend, "device", "cpu") != "cpu")
        self.steps = 0
        self._thread: threading.Thread | None = None
        self._stop = self._paused = False

    # -- what it is (read-only)
    capacity = property(lambda self: self.kv.capacity)
    limit = property(lambda self: self.kv.limit, doc="cells and positions of one sequence")
    pool = property(lambda self: self.kv.pool)
    parallel = property(lambda self: self.scheduler.parallel)
    max_queue = property(lambda self: self.scheduler.max_queue)
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    cond = property(lambda self: self.scheduler.cond)

    @property
    def counters(self) -> dict:
        """Every unit's counters (a copy)."""
        return {**asdict(self.scheduler.counters), "generated_tokens": self.post.generated_tokens,
                "steps": self.steps, "calls": self.runner.calls, **asdict(self.kv.counters)}

    # -- from any thread
    def submit(self, req: Request) -> Request:
        return self.scheduler.submit(req)

    def cancel(self, req: Request) -> None:
        """Stop a request (a client gone); its cells are freed at the next step."""
        req.cancel()
        with self.cond:
            self.cond.notify()

    def fault(self) -> str | None:
        """None while it works; a one-line reason while it fails every request (the last
        FAULT_STEPS steps raised or gave only non-finite logits: damaged weights)."""
        return self.health.fault()

    def stats(self) -> dict:
        with self.cond:
            waiting = len(self.waiting)
        # read without a lock while the stepping thread steps: gauges, not a snapshot (used + free
        # = capacity holds: one read)
        used = self.pool.used()
        return {**self.counters, "waiting": waiting, "active": len(self.running), "cells_used": used,
                "cells_free": self.capacity - used, "cells_cached_only": self.pool.cached_only(),
                "cells_bound": self.kv.past(), "capacity": self.capacity, "reserved": self.scheduler.reserved(),
                **self.kv.memory()}

    # -- the step
    def step(self) -> bool:
        """Plan, place, run, post-process; False when idle."""
        try:
            ran = self._step()
        except Exception as e:
            self.health.step_ended(f"{type(e).__name__}: {e}")
            raise
        self.health.step_ended()
        return ran

    def _step(self) -> bool:
        plan = self.scheduler.schedule()
        if plan is None:
            return False
        if not plan:  # requests run and none can go on: stepping again would spin
            raise RuntimeError("the scheduler planned nothing for its running requests")
        self.kv.tidy(sum(len(p.tokens) for p in plan))
        for call in self.kv.place(plan):
            self.kv.protect(call)
            self.post.masks_ahead(call)  # computed while the graph runs, joined before sampling
            rows = self.runner.run(call)
            self.kv.commit(call)
            self.scheduler.wrote(call, now())
            self.post.process(call, rows)
        self.steps += 1
        return True

    # -- its own thread (serve)
    def start(self) -> "Batcher":
        self._thread = threading.Thread(target=self._loop, name="edgekv-batcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify()
        if self._thread:
            self._thread.join(timeout=30)
        self.post.close()

    def pause(self, paused: bool = True) -> None:
        """Hold the stepping thread between steps (requests still queue), or let it go on."""
        with self.cond:
            self._paused = paused
            self.cond.notify()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self._stop and (self._paused or not (self.waiting or self.running)):
                    self.cond.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception as e:  # one bad step must not kill the server: fail what was running
                note(f"batcher: step failed: {type(e).__name__}: {e}")
                for req in list(self.running):
                    self.scheduler.finish(req, "error", f"the batcher step failed: {type(e).__name__}: {e}")

    # -- the caller's thread (chat)
    def run(self, req: Request) -> Request:
        """Submit `req` and step on the calling thread until it ends. Anything that stops it
        half-way (Ctrl-C, an error) undoes it whole (inside a turn: the turn's rollback)."""
        if self._thread is not None:
            raise RuntimeError("run() steps on the caller's thread; this batcher has its own")
        with self.turn():
            self.submit(req)
            while req.state is not DONE:
                if not self.step():
                    raise ContextOverflow("the request does not fit in the free cells of the pool",
                                          setting="capacity", fix="raise {}")
        return req

    @contextmanager
    def turn(self, undo=None):
        """What the block changes can be undone exactly: on an exception it is (the pool's
        owners, the kept sequences, every cell it overwrote), else it is committed. Inside
        another turn's block it joins that turn (whose rollback then undoes it). An interrupt
        on any of these lines leaves the turn committed or undone; only a rollback cut short (a
        second interrupt, or its own error) leaves it open, and the next turn finishes that
        rollback before it begins. `undo`: the caller's own part of a rollback (its fields, put
        back before the cells; called again by a rollback done again). Yields the Turn: its
        `committed` says, after an exception, whether what the block did was kept."""
        turns = self.kv.turns
        if turns.open and not turns.current.undoing:
            yield turns.current
            return
        try:
            if turns.open:  # a rollback cut short: the pool as it was before that turn, first
                self.rollback()
            turn = turns.begin(self.kv.kept, undo)
            yield turn
            turns.commit()  # the last line: nothing runs here once the turn is kept
        except BaseException:
            self.rollback()
            raise

    def rollback(self) -> None:
        """Undo the open turn (nothing when none is): running and waiting requests dropped, the
        cells' owners, the kept sequences and every overwritten cell as they were."""
        turns = self.kv.turns
        if turns.open:
            turns.mark_undoing()  # first: a rollback cut short from here on is finished, not joined
            self.scheduler.drop_all()
            turns.rollback()

    # -- kept sequences (chat), between their requests
    def hold(self) -> PoolSequence:
        """A new, empty sequence whose cells stay in the pool between its requests."""
        return self.kv.new(kept=True)

    def unhold(self, seq: PoolSequence) -> None:
        """Give a kept sequence's cells back to the pool; it is no longer the batcher's."""
        self._check_idle(seq)
        self.kv.unhold(seq)

    def can_truncate(self, seq: PoolSequence, n: int) -> bool:
        """`truncate(seq, n)` keeps all the next token needs (not after a ring wrapped, nor in a
        windowed pool once its local layers' ring lost the window before n): else start over."""
        can = getattr(self.kv, "can_truncate", None)  # (serve's fused slots: no windowed pool there)
        return can(seq, n) if can else 0 <= n <= seq.n and not seq.wrapped

    def truncate(self, seq: PoolSequence, n: int) -> None:
        """Forget everything of `seq` after its first n tokens (undo / regenerate)."""
        self._check_idle(seq)
        self.kv.truncate(seq, n)

    def reset(self, seq: PoolSequence) -> None:
        """Forget everything `seq` holds."""
        self._check_idle(seq)
        self.kv.reset(seq)

    def snapshot(self, seq: PoolSequence) -> dict[str, np.ndarray]:
        """Host copies of `seq`'s cells, in position order (slot i of the snapshot: its i-th token in context)."""
        return self.kv.snapshot(seq)

    def restore(self, seq: PoolSequence, snap: dict[str, np.ndarray], ids: list[int], w: int | None = None,
                sinks: int | None = None) -> None:
        """Replace what `seq` holds with a snapshot (snapshot.py), the token ids it was fed and,
        for a ring, its sinks (`w`: an old file's wrapped ring's write slot). All or nothing."""
        self._check_idle(seq)
        n = self.check_restore(seq, snap, ids, w, sinks)
        with self.turn():
            self.kv.reset(seq)
            if seq.ring:
                seq.enable_ring(seq.sinks if sinks is None else sinks)
            self.kv.restore(seq, snapshot.in_position_order(snap, n, w, seq.sinks), ids, n)

    def check_restore(self, seq: PoolSequence, snap: dict[str, np.ndarray], ids: list[int], w: int | None = None,
                      sinks: int | None = None) -> int:
        """The cells `restore` would take (nothing changes); an error saying why it would refuse:
        the cells, the ids, a ring's sinks and write slot (snapshot.check), a windowed pool's
        ring part (its window rings')."""
        n = snapshot.check(self.cache, seq, snap, ids, w, sinks)
        cells, ring = split_window(snapshot.in_position_order(snap, n, w, seq.sinks if sinks is None else sinks))
        self.kv.window_rings.to_restore(seq, cells, ring, ids, n)
        return n

    def _check_idle(self, seq: PoolSequence) -> None:
        if any(r.seq is seq for r in self.running) or any(r.ask.seq is seq for r in self.waiting):
            raise EdgeKVError("a held sequence changes only between its requests")
