"""Chat invariants, checked after every operation (reply, Ctrl-C in prefill and in decode, undo,
reset, save/load, ring wrap, drop-turns):
  - the sequence holds exactly the cells the session lists (len(ids) == seq.n == seq.pos while it
    is linear; a wrapped ring holds the capacity), the engine's pool has exactly those cells in
    use (none leaked, none shared), a ring's sinks stay in their cells, and positions never pass
    the bundle's verified context;
  - the ids the session holds are the conversation as the template renders it (a prefix of it);
  - the messages are whole exchanges, the newest ones of the conversation, in order;
  - a ring's sink slots are exactly the system prompt and the glue before the first user text;
  - the next greedy reply equals a fresh generator prefilled with the same prompt from scratch
    (while the cache has not wrapped: after a wrap the ring has forgotten tokens by design).
Ctrl-C is simulated by a backend wrapper that raises KeyboardInterrupt before or after a chosen
graph call (after: the cells are written but the engine's bookkeeping never ran)."""
import functools
import json
import shutil

import numpy as np
import pytest

from edgekv.chat.session import ChatSession
from edgekv.errors import EdgeKVError
from edgekv.format.bundle import load_bundle
from edgekv.runtime.backends import OrtBackend
from edgekv.runtime.cache import KVCache
from tests.stream_reference import Generator
from tests.conftest import chat_engine
from edgekv.runtime.sampling import SamplingParams
from edgekv.runtime.text import TextCodec, system_turn

SYSTEM = "You are terse."


class Interrupting:
    """A backend that raises KeyboardInterrupt at its `at`-th call from now, before or after the
    real call."""

    def __init__(self, inner):
        self.inner, self.at, self.after, self.calls = inner, None, False, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def arm(self, at: int, after: bool = False):
        self.at, self.after, self.calls = at, after, 0

    def run_cells(self, *a):
        self.calls += 1
        hit = self.at is not None and self.calls == self.at
        if hit and not self.after:
            self.at = None
            raise KeyboardInterrupt
        out = self.inner.run_cells(*a)
        if hit:
            self.at = None
            raise KeyboardInterrupt
        return out


@pytest.fixture(scope="module")
def small_bundle(tiny_bundle_int8, tmp_path_factory):
    """The tiny int8 bundle, declared verified for only 96 positions so that a ring reaches its
    verified context within a few turns (a smaller claim than the export's: safe)."""
    dst = tmp_path_factory.mktemp("small") / "b"
    shutil.copytree(tiny_bundle_int8, dst)
    man = json.loads((dst / "edgekv.json").read_text())
    man["max_context"] = 96
    (dst / "edgekv.json").write_text(json.dumps(man))
    return dst


def make(path, ctx, context, max_new=12, chunk=8):
    b = load_bundle(path)
    engine = chat_engine(Interrupting(OrtBackend(b, threads=1)), b, ctx, chunk)
    return ChatSession(b, TextCodec(b), engine, SamplingParams(), SYSTEM, max_new, context)


def expected_sinks(s: ChatSession) -> int:
    """Tokens of the rendered conversation before the first user message's text, counted from
    the text (the template's output), not from token comparisons."""
    text = s.codec.render(system_turn(SYSTEM) + [{"role": "user", "content": "UNIQUEMARK"}], add_generation_prompt=False)
    return len(s.codec.encode(text[: text.index("UNIQUEMARK")]))


def raw(s: ChatSession, ids) -> str:
    return s.codec.tok.decode(list(ids), skip_special_tokens=False)


def check(s: ChatSession, history: list[dict] | None = None):
    c = s.seq
    assert c.pos == len(s.ids), (c.pos, len(s.ids))
    assert c.pos <= s.bundle.max_context, f"position {c.pos} past the verified {s.bundle.max_context}"
    if c.wrapped:
        assert c.n == c.capacity
    else:
        assert c.n == len(s.ids), (c.n, len(s.ids))
    pool_holds_exactly_the_conversation(s)
    if c.ring and c.n >= c.sinks:
        assert c.cells[: c.sinks] == list(range(c.sinks))  # a ring's sinks are never overwritten
    if s.ring:
        assert c.sinks == min(expected_sinks(s), c.capacity // 2)
        if len(s.ids) >= c.sinks:
            held = raw(s, s.ids[: c.sinks])
            assert s.codec.render(s.conv.msgs(), add_generation_prompt=False).startswith(held)
    # the ids are the conversation as rendered (+ the next generation prompt). A reply is held as
    # the tokens generated, which may include special tokens its text leaves out: after a reply,
    # its prompt is compared (the reply itself is checked against a fresh prefill)
    ids, msgs = s.ids, s.conv.msgs()
    lp = getattr(s, "last_prompt_ids", None)
    if s.messages and lp and len(ids) > len(lp) and ids[:len(lp)] == lp:
        ids, msgs = lp, msgs[:-1]
    conv, held = s.codec.render(msgs, add_generation_prompt=True), raw(s, ids)
    assert conv.startswith(held) or held.startswith(s.codec.render(msgs, add_generation_prompt=False)), \
        (held[-80:], conv[-80:])
    roles = [m["role"] for m in s.messages]
    assert roles == ["user", "assistant"] * (len(roles) // 2), roles
    if history is not None and s.messages:
        assert history[-len(s.messages):] == s.messages  # the newest exchanges, whole and in order


def undo_checked(s: ChatSession, hist: list[dict], times: int = 1):
    """/undo `times` times; the sequence then holds a prefix of the remaining conversation and its
    next generation prompt, no token of the undone turns (check() also accepts a held reply)."""
    for _ in range(times):
        assert s.undo()
    hist[-2 * times:] = []
    check(s, hist)
    conv = s.codec.render(s.conv.msgs(), add_generation_prompt=True)
    assert conv.startswith(raw(s, s.ids)), (raw(s, s.ids)[-40:], conv[-40:])


def pool_holds_exactly_the_conversation(s: ChatSession):
    """The engine's cells in use are the conversation's, each held once: none leaked or shared."""
    refs = s.batcher.pool.refs
    assert sorted(s.seq.cells) == np.flatnonzero(refs).tolist() and refs.max(initial=0) <= 1, \
        (s.seq.cells, np.flatnonzero(refs).tolist())


@functools.lru_cache(maxsize=4)
def oracle_backend(path):
    """One backend per bundle for the oracle's decodes (a backend keeps no sequence state: each
    decode gets a cache of its own); never the one under test."""
    b = load_bundle(path)
    return b, OrtBackend(b, threads=1)


def fresh_greedy(path, prompt_ids, n, ctx):
    b, backend = oracle_backend(path)
    g = Generator(backend, KVCache(b, ctx))
    logits, out = g.prefill(prompt_ids), []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = g.decode_step(out[-1])
    return out


def reply_checked(s, path, q, history, ctx):
    """One reply; it must be what a fresh prefill of its prompt gives (unless the ring wrapped)."""
    wrapped_before = s.seq.wrapped
    text, st = s.reply(q)
    if st.stop_reason != "interrupted":
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": text}]
    prompt = s.last_prompt_ids
    if st.stop_reason != "interrupted":  # the prompt is the conversation (after any dropped turns) + q
        assert raw(s, prompt) == s.codec.render(s.conv.msgs()[:-2] + [{"role": "user", "content": q}])
    if not s.seq.wrapped and not wrapped_before and st.stop_reason != "interrupted":
        new = s.ids[len(prompt):]
        assert new == fresh_greedy(path, prompt, len(new), ctx)
    check(s, history)
    return text, st


def interrupt(s, q, at, after, hist):
    had = len(s.ids)
    s.batcher.backend.arm(at, after)
    _, st = s.reply(q)
    assert st.stop_reason == "interrupted"
    if not s.ring and had:  # a linear cache keeps what it held (at least the system prompt's slots)
        assert len(s.ids) >= expected_sinks(s)
    if s.messages and s.messages[-2]["content"] == q:  # recorded once its prompt was read
        hist += s.messages[-2:]
    check(s, hist)


def test_linear_session_every_operation(tiny_bundle_int8, tmp_path):
    ctx = 256
    s, hist = make(tiny_bundle_int8, ctx, "drop-turns"), []
    check(s, hist)
    reply_checked(s, tiny_bundle_int8, "What is the capital of France?", hist, ctx)
    # undoing the only exchange leaves the system prompt: the cache must keep no token of the
    # undone user turn (later undos cut inside a re-tokenized reply, where a stale token hides)
    undo_checked(s, hist)
    reply_checked(s, tiny_bundle_int8, "What is the capital of France?", hist, ctx)
    reply_checked(s, tiny_bundle_int8, "And of Germany?", hist, ctx)
    undo_checked(s, hist)
    reply_checked(s, tiny_bundle_int8, "And of Spain, please?", hist, ctx)
    # Ctrl-C at several points of a prefill (chunks of 8) and of a decode, before and after a call
    for at, after in [(1, False), (2, True), (3, False), (5, True), (8, False), (9, True)]:
        interrupt(s, f"Tell me about trains and tea, number {at}.", at, after, hist)
        reply_checked(s, tiny_bundle_int8, "Go on.", hist, ctx)
    undo_checked(s, hist, 2)
    reply_checked(s, tiny_bundle_int8, "Once more?", hist, ctx)
    s.save(tmp_path / "c.npz")
    t = make(tiny_bundle_int8, ctx, "drop-turns")
    t.load(tmp_path / "c.npz")
    check(t, hist)
    a = reply_checked(s, tiny_bundle_int8, "Last one.", list(hist), ctx)[0]
    b = reply_checked(t, tiny_bundle_int8, "Last one.", list(hist), ctx)[0]
    assert a == b
    s.reset()
    check(s, [])
    assert s.ids == [] and s.messages == []
    reply_checked(s, tiny_bundle_int8, "Hello again.", [], ctx)


def test_drop_turns_drops_whole_old_exchanges(tiny_bundle_int8):
    ctx = 64
    s, hist = make(tiny_bundle_int8, ctx, "drop-turns", max_new=10), []
    for i in range(8):
        reply_checked(s, tiny_bundle_int8, f"Fact {i} about tea?", hist, ctx)
        assert len(hist) - len(s.messages) == 2 * s.dropped_turns  # one count per whole exchange
    assert s.dropped_turns > 0


def test_ring_wraps_and_stops_at_the_verified_context(small_bundle, tmp_path):
    """ctx 56 of a bundle verified for 96 positions, replies longer than a quarter of that: the
    ring wraps, then a reply runs into the verified context (cut there), then turns are dropped
    and the conversation restarts from position 0."""
    ctx = 56  # the ring holds a system prompt of at most half the cache (26 tokens here)
    s, hist = make(small_bundle, ctx, "ring", max_new=60), []
    assert s.ring
    check(s, hist)
    seen = {"wrapped": False, "cut": False, "dropped": False}
    for i in range(16):
        if all(seen.values()) and i > 5:
            break
        _, st = reply_checked(s, small_bundle, f"tea {i}", hist, ctx)
        seen["wrapped"] |= s.seq.wrapped
        seen["cut"] |= st.stop_reason == "context"
        seen["dropped"] |= s.dropped_turns > 0
        if i == 3:  # Ctrl-C in a ring's decode, after the slot was written
            interrupt(s, "interrupt me", 4, True, hist)
    assert seen == {"wrapped": True, "cut": True, "dropped": True}
    if s.seq.wrapped:
        s.save(tmp_path / "r.npz")
        t = make(small_bundle, ctx, "ring", max_new=60)
        t.load(tmp_path / "r.npz")
        t.last_prompt_ids = s.last_prompt_ids  # not saved: the check's reference for the last reply
        check(t, hist)
        assert (t.seq.n, t.seq.pos, t.seq.sinks) == (s.seq.n, s.seq.pos, s.seq.sinks)
    s.reset()
    check(s, [])


def test_ring_sinks_are_the_system_prompt(tiny_bundle_int8):
    s = make(tiny_bundle_int8, 256, "ring")
    assert s.seq.sinks == expected_sinks(s) > 0
    s.reply("hello")
    check(s)


def test_ring_sinks_are_capped_at_half_the_cache(tiny_bundle_int8):
    """The system prompt's slots (the sinks) may take half the ring, not one slot more: a longer
    system prompt is refused, never partly overwritten (docs/chat.md)."""
    from edgekv.chat.conversation import sink_count

    b = load_bundle(tiny_bundle_int8)
    long_system = "You are a very terse assistant who answers about trains and tea."
    n = sink_count(TextCodec(b), long_system)

    def session(capacity):
        return ChatSession(b, TextCodec(b), chat_engine(OrtBackend(b, threads=1), b, capacity),
                           SamplingParams(), long_system, 8, "ring")

    assert session(2 * n).seq.sinks == n  # exactly half: kept whole
    with pytest.raises(EdgeKVError, match="system prompt too long for the ring"):
        session(2 * n - 2)  # half is n - 1


def test_message_longer_than_the_cache_is_refused(tiny_bundle_int8):
    s = make(tiny_bundle_int8, 32, "drop-turns")
    with pytest.raises(EdgeKVError, match="message too long"):
        s.reply("trains and tea " * 40)
    check(s, [])
