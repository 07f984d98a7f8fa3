"""Chat on the engine, hostile: Ctrl-C at every line of a turn, random operations against oracles
(a fresh prefill; the pool owning exactly the conversation's cells), the engine's ring = the
Generator's ring Sequence token by token, save files from before the engine, and a held
sequence's guards (busy, reservations, restore half-way, a prefill outside a turn)."""
import random
import sys

import numpy as np
import pytest

from edgekv.chat.session import ChatSession
from edgekv.errors import EdgeKVError
from edgekv.format.bundle import load_bundle
from edgekv.runtime.backends import OrtBackend
from edgekv.runtime.cache import KVCache
from edgekv.runtime.batching import Request
from edgekv.runtime.sampling import SamplingParams
from edgekv.runtime.text import TextCodec
from tests.conftest import chat_engine, interrupt_points, lines_run
from tests.ring_reference import RingGenerator, RingSequence
from tests.test_chat_invariants import Interrupting, fresh_greedy, small_bundle  # noqa: F401  (fixture)
from tests.test_chat_invariants import pool_holds_exactly_the_conversation as refs_ok

SYSTEM = "You are terse."
QS = ["What is the capital of France?", "And of Germany?", "Tell me about trains and tea.", "Go on.",
      "robots?", "Café 東京 🙂", "x", "Der schnelle braune Fuchs."]


def ring_sequence(ctx, bundle, sinks):
    """The test-only single-stream ring (tests/ring_reference.py), the oracle of chat's."""
    seq = RingSequence(ctx, bundle.max_context)
    seq.enable_ring(sinks)
    return seq


def make(path, ctx, context, max_new=12, chunk=8, params=None):
    b = load_bundle(path)
    engine = chat_engine(Interrupting(OrtBackend(b, threads=1)), b, ctx, chunk)
    return ChatSession(b, TextCodec(b), engine, params or SamplingParams(), SYSTEM, max_new, context)


class NoRows:
    """Host memory that only reads/writes from slot 0 (like a device memory): the `whole` paths."""

    def __init__(self, inner):
        self.inner, self.device = inner, inner.device

    def free_bytes(self):
        return self.inner.free_bytes()

    def alloc(self, shape, dtype):
        return self.inner.alloc(shape, dtype)

    def ptr(self, buf):
        return self.inner.ptr(buf)

    def read(self, buf, n):
        return self.inner.read(buf, n)

    def write(self, buf, arr):
        self.inner.write(buf, arr)


def state(s: ChatSession):
    """Everything a rolled-back turn must leave exactly as it was."""
    e, h = s.batcher, s.seq
    snap = e.snapshot(h)
    return dict(refs=e.pool.refs.copy().tolist(), cells=h.cells, ids=h.ids, sinks=h.sinks,
                msgs=[dict(m) for m in s.messages], dropped=s.dropped_turns,
                rng=repr(s.rng.bit_generator.state), kv={k: v.tobytes() for k, v in snap.items()},
                waiting=len(e.waiting), active=len(e.running), turn=e.kv.turns.current,
                last=s.last, prompt_ids=s.last_prompt_ids, turns=len(s.turns))  # turns: /stats' totals


# -- 1. KeyboardInterrupt at every line of the engine during a turn (interrupt_points) -------------

class LineInterrupt:
    """Raise KeyboardInterrupt at the k-th traced line executed in the batcher's units, the cache,
    the pool or the chat session."""

    FILES = ("edgekv/runtime/batching/batcher.py", "edgekv/runtime/batching/scheduler.py", "edgekv/runtime/batching/kv.py",
             "edgekv/runtime/batching/turns.py", "edgekv/runtime/batching/poolseq.py", "edgekv/runtime/batching/runner.py",
             "edgekv/runtime/batching/postprocess.py", "edgekv/runtime/batching/request.py", "edgekv/runtime/batching/plan.py",
             "edgekv/runtime/batching/window_rings.py", "edgekv/runtime/cache.py", "edgekv/runtime/pool.py",
             "edgekv/chat/session.py", "edgekv/chat/policies.py", "edgekv/chat/conversation.py")

    def __init__(self, k):
        self.k, self.seen, self.fired = k, 0, False

    def __call__(self, frame, event, arg):
        if self.fired:
            return None
        if not frame.f_code.co_filename.endswith(self.FILES):
            return None
        return self.local

    def local(self, frame, event, arg):
        if self.fired:
            return None
        if event == "line":
            self.seen += 1
            if self.seen == self.k:
                self.fired = True
                self.where = (frame.f_code.co_filename.split("edgekv/")[-1], frame.f_lineno, frame.f_code.co_name)
                raise KeyboardInterrupt
        return self.local


@pytest.mark.parametrize("context", ["ring", "drop-turns"])
def test_interrupt_at_every_engine_line_rolls_back_exactly(tiny_bundle_int8, context):
    """A ring that wraps (ctx 56, small chunks), interrupted at every line its turn runs
    (interrupt_points). The points come from an identical session's uninterrupted turn (the
    reference), which must run the same lines: a turn rolled back is the turn before it."""
    s = make(tiny_bundle_int8, 56, context, max_new=10, chunk=5)
    ref = make(tiny_bundle_int8, 56, context, max_new=10, chunk=5)
    for q in QS[:3]:
        assert s.reply(q)[0] == ref.reply(q)[0]
    q = QS[3]
    want, lines = lines_run(LineInterrupt.FILES, lambda: ref.reply(q)[0])
    whole = state(ref)  # what an uninterrupted turn leaves
    ks = interrupt_points(lines)
    before = state(s)
    fired_any, late = 0, None
    for k in ks:
        tr = LineInterrupt(k)
        sys.settrace(tr)
        try:
            text = s.reply(q)[0]
        except KeyboardInterrupt:
            text = None  # landed before reply's try: before its turn
        finally:
            sys.settrace(None)
        assert tr.fired, (k, len(ks))  # the same lines as the reference's turn
        fired_any += 1
        if s.messages != before["msgs"]:  # after its turn committed: kept whole, the reply too
            got = state(s)
            # (its own seed, its own timings)
            assert all(got[key] == whole[key] for key in got if key not in ("rng", "last")), (k, tr.where)
            assert text == want, (k, tr.where)  # and reply says so: an interrupt then cancels nothing
            late = tr.where  # nothing later can be rolled back: stop here
            break
        after = state(s)
        for key in before:  # the turn too: an interrupt in turn()'s own lines never leaves it open
            assert after[key] == before[key], (k, key, tr.where)
    assert fired_any > 20
    print("FIRED", context, fired_any, s.seq.wrapped, "late interrupt at", late)
    if not late:  # the turn uninterrupted gives the reference's reply
        assert s.reply(q)[0] == want


def cut_rows_write(monkeypatch, cache, at: int) -> list:
    """The cache's at-th write_rows from now raises KeyboardInterrupt (a second Ctrl-C in a
    rollback); returns the list of the starts written (the cut one included)."""
    write_rows, calls = cache.write_rows, []

    def cut(start, rows):
        calls.append(start)
        if len(calls) == at:
            raise KeyboardInterrupt
        write_rows(start, rows)

    monkeypatch.setattr(cache, "write_rows", cut)
    return calls


def test_a_load_whose_rollback_is_cut_short_is_rolled_back_whole_by_the_session(tiny_bundle_int8, tmp_path,
                                                                                 monkeypatch):
    """Ctrl-C at the end of a /load's restore, then again while the rollback writes the old
    conversation's cells back: the session finishes that rollback before the interrupt leaves
    load, so the conversation is exactly as before at once (not only at its next turn)."""
    from edgekv.chat import persistence

    other = make(tiny_bundle_int8, 56, "drop-turns")
    other.reply(QS[1])
    other.reply(QS[2])
    f = tmp_path / "other.npz"
    other.save(str(f))
    s = make(tiny_bundle_int8, 56, "drop-turns")
    s.reply(QS[0])
    before = state(s)
    restore, calls = persistence.restore, []

    def restore_then_interrupt(session, saved):
        restore(session, saved)
        calls.append(cut_rows_write(monkeypatch, s.batcher.cache, 1))
        raise KeyboardInterrupt

    monkeypatch.setattr(persistence, "restore", restore_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        s.load(str(f))
    assert len(calls[0]) >= 2  # cut short once, then done again whole
    assert not s.batcher.kv.turns.open and state(s) == before


def test_an_interrupt_on_any_line_of_a_bare_turn_leaves_it_closed_and_undone(tiny_bundle_int8):
    """`with batcher.turn(): batcher.run(...)` alone, no session code around it to tidy up: an
    interrupt on any line it runs (turn()'s own included) leaves no turn open and the pool, the
    kept ring and its cells exactly as before."""
    s = make(tiny_bundle_int8, 56, "ring", max_new=10, chunk=5)
    ref = make(tiny_bundle_int8, 56, "ring", max_new=10, chunk=5)
    for q in QS[:3]:
        s.reply(q), ref.reply(q)
    prompt = s.codec.chat_ids([{"role": "user", "content": QS[3]}])

    def bare_turn(session):
        with session.batcher.turn():
            session.batcher.run(Request(prompt, 10, seq=session.seq, feed_last=True))

    _, lines = lines_run(LineInterrupt.FILES, lambda: bare_turn(ref))
    ks = interrupt_points(lines)
    assert any(f.endswith("batcher.py") for f, _ in lines)
    before = state(s)
    for k in ks:
        tr = LineInterrupt(k)
        sys.settrace(tr)
        try:
            bare_turn(s)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        assert tr.fired, (k, len(ks))
        assert not s.batcher.kv.turns.open, tr.where
        assert state(s) == before, tr.where  # (turn() runs no line once its turn is committed)
    assert len(ks) > 20


def test_a_rollback_cut_short_by_a_second_interrupt_is_done_whole_by_the_next(tiny_bundle_int8, monkeypatch):
    """Ctrl-C at a wrapped ring's third call of a turn, then again while the rollback writes the
    overwritten cells back (after its first run of rows: partly undone): the turn stays open (not
    closed half undone), and the next rollback puts every cell, owner and id back as before."""
    s = make(tiny_bundle_int8, 56, "ring", max_new=10, chunk=5)
    for q in QS[:3]:
        s.reply(q)
    assert s.seq.wrapped
    before = state(s)
    cache = s.batcher.cache
    assert cache.reads_rows  # (a memory that cannot copy row ranges restores the whole cache at once)
    calls = cut_rows_write(monkeypatch, cache, 2)
    s.batcher.backend.arm(3, after=True)
    with pytest.raises(KeyboardInterrupt):
        with s.batcher.turn():
            s.batcher.run(Request(s.codec.chat_ids([{"role": "user", "content": QS[3]}]), 10, seq=s.seq,
                                  feed_last=True))
    assert len(calls) == 2 and s.batcher.kv.turns.open  # cut short: still open, nothing claimed done
    s.batcher.rollback()
    assert state(s) == before and not s.batcher.kv.turns.open


# -- 2. random operations against oracles --------------------------------------------------------

@pytest.mark.parametrize("rows", [True, False])
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("context", ["ring", "drop-turns"])
def test_random_operations(small_bundle, tmp_path, context, seed, rows):  # noqa: F811
    rnd = random.Random(seed)
    ctx = 56

    def fresh():
        t = make(small_bundle, ctx, context, max_new=rnd.choice([6, 20, 60]), chunk=rnd.choice([3, 8, 128]))
        if not rows:
            t.batcher.cache.memory = NoRows(t.batcher.cache.memory)
            assert not t.batcher.cache.reads_rows
        return t
    s = fresh()
    if rnd.random() < 0.5:
        s.warm_system(str(tmp_path / "pc.npz"))
    for i in range(40):
        op = rnd.choice(["reply"] * 4 + ["interrupt", "undo", "reset", "saveload", "raise", "system", "warm"])
        if op == "system":
            try:
                s.set_system(rnd.choice([SYSTEM, None, "Be brief.", "trains " * 20]))
            except EdgeKVError:
                pass
        elif op == "warm":
            s.reset()
            s.warm_system(str(tmp_path / "pc.npz"))
        if op == "reply":
            wrapped = s.seq.wrapped
            text, st = s.reply(rnd.choice(QS))
            if not wrapped and not s.seq.wrapped:
                p = s.last_prompt_ids
                new = s.ids[len(p):]
                assert new == fresh_greedy(small_bundle, p, len(new), ctx), (i, op)
        elif op in ("interrupt", "raise"):
            before = state(s)
            be = s.batcher.backend
            if op == "interrupt":
                be.arm(rnd.randint(1, 12), rnd.random() < 0.5)
                _, st = s.reply(rnd.choice(QS))
                fired = be.at is None
                be.at = None
                if fired:
                    assert st.stop_reason == "interrupted"
            else:  # an error from the backend after it wrote the cells
                real = be.inner.run_cells
                n = [0]
                at = rnd.randint(1, 12)

                def boom(*a):
                    n[0] += 1
                    out = real(*a)
                    if n[0] == at:
                        raise EdgeKVError("boom")
                    return out
                be.inner.run_cells = boom
                try:
                    s.reply(rnd.choice(QS))
                    fired = False
                except EdgeKVError:
                    fired = True
                finally:
                    del be.inner.run_cells
            if fired:
                after = state(s)
                for key in before:
                    assert after[key] == before[key], (i, op, key)
        elif op == "undo":
            s.undo()
        elif op == "reset":
            s.reset()
        elif op == "saveload":
            s.save(tmp_path / "c.npz")
            t = fresh()
            t.max_new = s.max_new
            t.set_system(s.system)  # (a different one: see test_load_takes_the_files_sinks)
            t.load(tmp_path / "c.npz")
            assert (t.seq.ids, t.seq.sinks, t.messages) == (s.seq.ids, s.seq.sinks, s.messages)
            a, b = s.batcher.snapshot(s.seq), t.batcher.snapshot(t.seq)
            assert all(np.array_equal(a[k], b[k]) for k in a)
            s = t
        refs_ok(s)
        assert s.seq.pos <= s.bundle.max_context
        assert s.batcher.kv.turns.current is None and not s.batcher.running and not s.batcher.waiting


# -- 3. a ring on the engine against the Sequence ring, token by token (chunk 1) -------------------

@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(repeat_penalty=1.3, repeat_last_n=20),
                                    SamplingParams(temperature=0.8, top_k=20, repeat_penalty=1.2, seed=5)])
def test_ring_matches_sequence_ring_token_by_token(tiny_bundle_int8, params):
    """With one token per call both rings overwrite the same (oldest) token at each step: the
    engine's held ring must give the same tokens (sampler, repetition history and rng included)
    as the Generator's ring Sequence."""
    from edgekv.runtime.sampling import sample

    ctx = 56
    s = make(tiny_bundle_int8, ctx, "ring", max_new=100, chunk=1, params=params)
    b = s.bundle
    g = RingGenerator(OrtBackend(b, threads=1), KVCache(b, ctx), ring_sequence(ctx, b, s.seq.sinks), prefill_chunk=1)
    rng = np.random.default_rng(params.seed)
    log = []
    real = s.batcher.submit

    def submit(req):
        log.append((req.ask.seq.ids, list(req.prompt)))
        return real(req)
    s.batcher.submit = submit
    compared = 0
    for q in QS[:5]:
        s.reply(q)
        held_before, prompt = log[-1]
        if held_before != g.seq.ids:
            break  # the session truncated / reset: stop comparing
        logits = g.prefill(prompt)
        fed = s.seq.ids[len(held_before) + len(prompt):]
        for t in fed:
            assert sample(logits, params, rng, g.seq.recent(params.repeat_last_n)) == t, (q, compared)
            logits = g.decode_step(t)
            compared += 1
        assert g.seq.ids == s.seq.ids
    assert compared > 80 and s.seq.wrapped


# -- 4. restore that fails half-way --------------------------------------------------------------

def test_restore_interrupted_half_way_keeps_pool_consistent(tiny_bundle_int8, tmp_path):
    s = make(tiny_bundle_int8, 128, "drop-turns")
    s.reply("What is the capital of France?")
    s.save(tmp_path / "c.npz")
    t = make(tiny_bundle_int8, 128, "drop-turns")  # holds only the system prompt
    memory = t.batcher.cache.memory
    real, written = memory.write_slots, []

    def write_slots(buf, slots, rows):  # Ctrl-C while the snapshot is copied in: after its first buffer
        if written:
            raise KeyboardInterrupt
        written.append(len(slots))
        real(buf, slots, rows)
    memory.write_slots = write_slots
    with pytest.raises(KeyboardInterrupt):
        t.load(tmp_path / "c.npz")
    memory.write_slots = real
    assert written  # the interrupt came half-way, not before the copy
    refs_ok(t)  # the pool must own exactly the held cells


# -- 5. held sequences used beside one another / while a request is running -----------------------

def test_truncate_while_a_request_runs_is_refused(tiny_bundle_int8):
    b = load_bundle(tiny_bundle_int8)
    e = chat_engine(OrtBackend(b, threads=1), b, 64, 4)
    h = e.hold()
    e.run(Request(list(range(10, 30)), 0, seq=h))
    req = Request(list(range(40, 50)), 5, seq=h, feed_last=True)
    e.submit(req)
    e.step()
    e.step()
    with pytest.raises((ValueError, EdgeKVError)):
        e.truncate(h, 5)  # the running request still lists the cells this drops


def test_unhold_gives_a_held_sequence_back_whole(tiny_bundle_int8):
    """hold .. unhold: the cells go back to the pool and the sequence is no longer the pool's
    (compaction would rename its cells; a windowed pool would keep its ring)."""
    b = load_bundle(tiny_bundle_int8)
    e = chat_engine(OrtBackend(b, threads=1), b, 64, 4)
    h, other = e.hold(), e.hold()
    e.run(Request(list(range(10, 30)), 3, seq=h))
    e.run(Request(list(range(40, 45)), 2, seq=other))
    assert h.n >= 20 and e.pool.free() == e.pool.capacity - h.n - other.n
    waiting = Request([7, 8], 2, seq=h)
    e.submit(waiting)
    with pytest.raises(EdgeKVError):  # not while a request of it waits
        e.unhold(h)
    while waiting.finish_reason is None:
        e.step()
    e.unhold(h)
    assert h not in e.kv.sequences and h not in e.kv.kept and other in e.kv.kept
    assert e.pool.free() == e.pool.capacity - other.n and h.n == 0


def test_prefill_only_request_reserves_its_whole_prompt(tiny_bundle_int8):
    """A held request with max_tokens=0 (ChatSession.prefill) feeds every prompt token: its
    admission must reserve them all, or a pool shared with another held sequence runs dry."""
    b = load_bundle(tiny_bundle_int8)
    e = chat_engine(OrtBackend(b, threads=1), b, 32, 128)
    a, c = e.hold(), e.hold()
    e.run(Request(list(range(10, 20)), 0, seq=a))  # 10 cells
    with pytest.raises(EdgeKVError):  # 23 tokens, 22 free cells: refused, not a RuntimeError
        e.run(Request(list(range(40, 63)), 0, seq=c))


def test_stats_of_decode_rate_is_sane(tiny_bundle_int8):
    s = make(tiny_bundle_int8, 256, "drop-turns", max_new=20)
    s.reply("Tell me about trains and tea.")
    st = s.last
    assert st.ttft_s > 0 and st.prefill_s > 0
    if st.new_tokens > 1:
        assert st.decode_steps == st.new_tokens - 1 or st.stop_reason == "stop"
        assert st.decode_s > 0


def test_load_takes_the_files_sinks(tiny_bundle_int8, tmp_path):
    """/load replaces the system prompt with the file's; a ring's sinks must follow (they are the
    system prompt's cells), else the ring keeps part of a user turn forever or overwrites part
    of the system prompt."""
    s = make(tiny_bundle_int8, 64, "ring")
    s.set_system("Be brief.")
    s.reply("hello")
    s.save(tmp_path / "c.npz")
    t = make(tiny_bundle_int8, 64, "ring")  # SYSTEM: more sink tokens
    t.load(tmp_path / "c.npz")
    assert t.system == "Be brief."
    assert t.seq.sinks == s.seq.sinks, (t.seq.sinks, s.seq.sinks)


def test_interrupted_prefill_outside_a_turn_leaves_the_engine_usable(tiny_bundle_int8):
    """warm_system's prefill runs outside a turn: an error or Ctrl-C in it must not leave the
    request active (every later turn then fails) nor its cells owned by nobody."""
    s = make(tiny_bundle_int8, 64, "drop-turns", chunk=4)
    s.batcher.backend.arm(3, True)
    with pytest.raises(KeyboardInterrupt):
        s.warm_system(None)
    assert not s.batcher.running and not s.batcher.waiting
    refs_ok(s)
    s.reply("hello")  # must not raise "a held sequence runs one request at a time"
    refs_ok(s)


@pytest.mark.parametrize("wrapped_at", [0, 5, 29])
def test_old_format_wrapped_ring_file_loads_in_position_order(tiny_bundle_int8, tmp_path, wrapped_at):
    """A file written before the engine (a Generator ring's slots in slot order, ring.w its write
    slot) loads and continues exactly as the Generator ring it came from."""
    import json

    from edgekv.chat import persistence

    ctx = 56
    t = make(tiny_bundle_int8, ctx, "ring")
    sinks = t.seq.sinks
    b = t.bundle
    g = RingGenerator(OrtBackend(b, threads=1), KVCache(b, ctx), ring_sequence(ctx, b, sinks), prefill_chunk=7)
    rs = np.random.default_rng(wrapped_at)
    g.prefill(rs.integers(3, 300, ctx + (ctx - sinks) + wrapped_at).tolist())
    assert g.seq.n == ctx and g.seq.pos > ctx
    meta = {"edgekv_chat": persistence.FORMAT, "bundle_sha256": b.manifest["source"].get("sha256"),
            "bundle_scheme": b.scheme.name, "system": SYSTEM, "messages": [], "ids": g.seq.ids,
            "ring": {"w": g.seq.w, "sinks": sinks}}
    with open(tmp_path / "old.npz", "wb") as f:
        np.savez(f, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **g.cache.read(g.seq.n))
    linear = make(tiny_bundle_int8, ctx, "drop-turns")
    with pytest.raises(EdgeKVError, match="wrapped") as refused:  # a session without a ring: how to load it
        linear.load(tmp_path / "old.npz", trust_unrecorded=True)
    assert refused.value.setting == "context_policy"
    t.load(tmp_path / "old.npz", trust_unrecorded=True)
    assert t.seq.ids == g.seq.ids and t.seq.wrapped
    req = t.batcher.run(Request([7], 30, seq=t.seq, feed_last=True, record_logits=True))
    want = [g.decode_step(7).copy()] + [g.decode_step(tok).copy() for tok in req.out[:-1]]
    assert [int(np.argmax(x)) for x in want] == req.out
    np.testing.assert_allclose(np.stack(req.logits), np.stack(want), atol=2e-2)
    refs_ok(t)


def test_a_failed_turn_puts_back_every_cell_it_overwrote(tiny_bundle_int8):
    """`with batcher.turn():` around a request that wraps a kept ring (overwriting cells that
    were in use when the turn began) and then fails: the pool's owners, the sequence and the
    contents of every cell are as before the turn (the oracle: a snapshot taken before it)."""
    b = load_bundle(tiny_bundle_int8)
    e = chat_engine(OrtBackend(b, threads=1), b, 32, 8)
    seq = e.hold()
    seq.enable_ring(4)
    e.run(Request(list(range(10, 30)), 0, seq=seq))  # 20 of 32 cells
    before = (e.pool.refs.copy(), seq.cells, seq.ids, {k: v.copy() for k, v in e.snapshot(seq).items()})
    whole = e.cache.read(e.capacity)
    with pytest.raises(RuntimeError, match="after the wrap"):
        with e.turn():
            e.run(Request(list(range(40, 70)), 0, seq=seq))  # 30 more: the ring overwrites 18 of its own
            assert seq.wrapped
            raise RuntimeError("after the wrap")
    assert (e.pool.refs == before[0]).all() and (seq.cells, seq.ids) == (before[1], before[2])
    after = e.snapshot(seq)
    assert all(np.array_equal(after[k], before[3][k]) for k in after)
    assert all(np.array_equal(e.cache.read(e.capacity)[k][c], whole[k][c]) for k in whole for c in seq.cells)
    assert e.kv.turns.current is None and not e.running
