"""Chat: kept cache = from scratch, commands, piped conversations, a real terminal on the real model."""
import json
import signal
import sys

import numpy as np
import pytest

from edgekv.runtime.backends import OrtBackend
from edgekv.runtime.cache import KVCache
from edgekv.chat.session import ChatSession
from edgekv.errors import EdgeKVError
from tests.stream_reference import Generator
from edgekv.runtime.sampling import SamplingParams
from edgekv.format.bundle import load_bundle
from edgekv.runtime.text import TextCodec
from tests.conftest import ROOT, chat_engine, run_edgekv


def session(path, ctx=256, max_new=12, context="drop-turns"):
    b = load_bundle(path)
    return ChatSession(b, TextCodec(b), chat_engine(OrtBackend(b, threads=1), b, ctx), SamplingParams(),
                       "You are terse.", max_new, context)


def test_kept_cache_equals_prefill_from_scratch(tiny_bundle_int8):
    s = session(tiny_bundle_int8)
    s.reply("What is the capital of France?")
    n_before = s.seq.n
    text2, st2 = s.reply("And of Germany?")
    assert st2.prompt_tokens < len(s.last_prompt_ids) // 2 or n_before < 4  # only the new turn was prefilled
    ids2 = s.ids[len(s.last_prompt_ids):]
    # from scratch: the same prompt ids prefilled in one go into a fresh cache, then greedy decode
    b = load_bundle(tiny_bundle_int8)
    g = Generator(OrtBackend(b, threads=1), KVCache(b, 256))
    logits = g.prefill(s.last_prompt_ids)
    fresh = []
    for _ in range(len(ids2)):
        t = int(np.argmax(logits))
        fresh.append(t)
        logits = g.decode_step(t)
    assert fresh == ids2


def test_undo_and_reset(tiny_bundle_int8):
    s = session(tiny_bundle_int8)
    s.reply("first")
    n1 = s.seq.n
    s.reply("second")
    assert s.undo() and len(s.messages) == 2 and s.seq.n <= n1 + 1
    s.reset()
    assert s.messages == [] and s.seq.n == 0
    assert not s.undo()


def test_save_and_load_roundtrip(tiny_bundle_int8, tmp_path):
    s = session(tiny_bundle_int8)
    s.reply("What is the capital of France?")
    s.save(tmp_path / "c.npz")
    t = session(tiny_bundle_int8)
    t.load(tmp_path / "c.npz")
    assert t.messages == s.messages and t.ids == s.ids and t.seq.n == s.seq.n
    a, _ = s.reply("And of Germany?")
    b, _ = t.reply("And of Germany?")
    assert a == b


def test_piped_json_conversation_and_unknown_command(tiny_bundle_int8):
    r = run_edgekv("chat", tiny_bundle_int8, "--json", "--temperature", "0", "--max-new-tokens", "6",
                   input="hello\n/nonsense\nthe capital of France?\n/undo\nagain\n")
    assert r.returncode == 0, r.stderr
    turns = [json.loads(l) for l in r.stdout.splitlines()]
    assert [t["user"] for t in turns] == ["hello", "the capital of France?", "again"]
    assert "unknown command /nonsense" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("context", ["ring", "drop-turns"])
def test_long_piped_conversation_on_small_ctx_ends_normally(tiny_bundle_int8, context):
    lines = "".join(f"Tell me fact number {i} about trains and tea.\n" for i in range(40))
    r = run_edgekv("chat", tiny_bundle_int8, "--ctx", "96", "--temperature", "0", "--max-new-tokens", "16",
                   "--context", context, "--json", input=lines)
    assert r.returncode == 0, r.stderr
    turns = [json.loads(l) for l in r.stdout.splitlines()]
    assert len(turns) == 40 and all(t["kv_cells"] <= 96 for t in turns)
    # the tiny bundle is verified for 256 positions: ~1,500 tokens of talk cross it several times
    assert all(t["position"] <= 256 for t in turns) and turns[-1]["dropped_turns"] > 0
    if context == "ring":  # the ring overwrote before it ever had to drop a turn
        first_wrap = next(i for i, t in enumerate(turns) if t["ring_wrapped"])
        assert turns[first_wrap]["dropped_turns"] == 0


def test_ring_chat_keeps_the_cache_like_a_fresh_prefill_until_it_wraps(tiny_bundle_int8):
    """Before the ring wraps, the ring policy is the kept cache: greedy replies equal those of a
    session that prefills the whole conversation again each turn."""
    s = session(tiny_bundle_int8, 256, context="ring")
    assert s.seq.sinks > 0  # the system prompt's slots
    b = load_bundle(tiny_bundle_int8)
    for q in ("hello there", "and again"):
        s.reply(q)
        assert not s.seq.wrapped
        new = s.ids[len(s.last_prompt_ids):]
        g = Generator(OrtBackend(b, threads=1), KVCache(b, 256))
        logits = g.prefill(s.last_prompt_ids)
        fresh = []
        for _ in range(len(new)):
            fresh.append(int(np.argmax(logits)))
            logits = g.decode_step(fresh[-1])
        assert fresh == new


def test_ring_chat_saves_and_loads_a_wrapped_cache(tiny_bundle_int8, tmp_path):
    def ring_session():
        return session(tiny_bundle_int8, 64, context="ring")

    s = ring_session()
    for i in range(8):
        s.reply(f"tea {i}")
        if s.seq.wrapped:
            break
    assert s.seq.wrapped and s.dropped_turns == 0
    s.save(tmp_path / "c.npz")
    t = ring_session()
    t.load(tmp_path / "c.npz")
    assert (t.seq.n, t.seq.pos, t.seq.sinks) == (s.seq.n, s.seq.pos, s.seq.sinks)
    assert s.reply("and now?")[0] == t.reply("and now?")[0]


@pytest.mark.slow
def test_real_terminal_conversation(real_bundle_int4):  # the quickstart's bundle: one real export per run
    pexpect = pytest.importorskip("pexpect")
    # the child gets Ctrl-C's default handling even when this test runs where SIGINT is ignored
    # (a background job): a Python started with SIGINT ignored would never raise KeyboardInterrupt
    child = pexpect.spawn(sys.executable, ["-m", "edgekv", "chat", str(real_bundle_int4), "--temperature", "0",
                                           "--max-new-tokens", "200"], cwd=str(ROOT), encoding="utf-8", timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        child.expect("> ")
        child.sendline("What is the capital of France?")
        child.expect("Paris")
        child.expect("tok/s")
        child.expect("> ")
        child.sendline("And of Germany?")
        child.expect("Berlin")  # the conversation is remembered
        child.expect("> ")
        child.sendline("/frobnicate")
        child.expect("unknown command")
        child.expect("> ")
        child.sendline("Write a long story about a dragon who learns to cook.")
        child.expect("cook.\r\n")  # our own line, echoed
        child.expect(r"\w+ \w+ \w+ \w+")  # the answer has started streaming
        child.sendcontrol("c")
        child.expect(r"\[stopped\]")
        child.expect("> ")
        child.sendline("/reset")
        child.expect("forgotten")
        child.expect("> ")
        child.sendline("What is the capital of France?")
        child.expect("Paris")  # the next turn works after Ctrl-C and /reset
        child.expect("> ")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_prompt_cache_restores_and_rebuilds(tiny_bundle_int8, tmp_path):
    pc = tmp_path / "sys.npz"
    s1 = session(tiny_bundle_int8)
    assert "saved" in s1.warm_system(str(pc)) and pc.is_file()
    a, _ = s1.reply("What is the capital of France?")
    s2 = session(tiny_bundle_int8)
    assert "restored" in s2.warm_system(str(pc))
    b, st = s2.reply("What is the capital of France?")
    assert a == b and st.prompt_tokens < len(s2.last_prompt_ids)
    s3 = session(tiny_bundle_int8)
    s3.system = "A different system prompt."
    assert "saved" in s3.warm_system(str(pc))  # stale for this prompt: rebuilt, not trusted
    assert s3.system == "A different system prompt."
    pc.write_bytes(pc.read_bytes()[:200])  # ours but damaged (truncated): rebuilt
    s4 = session(tiny_bundle_int8)
    assert "saved" in s4.warm_system(str(pc))
    assert "restored" in session(tiny_bundle_int8).warm_system(str(pc))
    pc.write_bytes(b"")  # empty: nothing to lose, rebuilt
    assert "saved" in session(tiny_bundle_int8).warm_system(str(pc))


def test_prompt_cache_never_overwrites_a_file_that_is_not_one(tiny_bundle_int8, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("Hi\n")
    with pytest.raises(EdgeKVError, match="not an edgekv prompt cache"):
        session(tiny_bundle_int8).warm_system(str(notes))
    assert notes.read_text() == "Hi\n"
    link = tmp_path / "link.npz"
    link.symlink_to(notes)
    with pytest.raises(EdgeKVError, match="symbolic link"):
        session(tiny_bundle_int8).warm_system(str(link))
    assert link.is_symlink() and notes.read_text() == "Hi\n"


# -- chat --json-schema (issue 26 item 4) --------------------------------------------------------

REPLY_SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "calm"]},
                                                 "short": {"type": "boolean"}},
                "required": ["mood", "short"], "additionalProperties": False}


def test_every_turn_of_a_session_follows_the_reply_grammar(tiny_bundle_int8):
    """Three sampled turns on the tiny model, each reply validating (jsonschema the oracle): a
    session that kept the constraint for turn 1 only (or reused its spent matcher) fails on turn 2."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    from edgekv.runtime.grammar_build import json_schema
    from edgekv.runtime.grammar_constraint import compile_grammar
    from edgekv.runtime.grammar_tokenizer import tokenizer_for

    b = load_bundle(tiny_bundle_int8)
    compiled = compile_grammar(tokenizer_for(b), json_schema(REPLY_SCHEMA))
    s = ChatSession(b, TextCodec(b), chat_engine(OrtBackend(b, threads=1), b, 256), SamplingParams(temperature=1.0,
                    seed=4), "You are terse.", 60, reply_grammar=compiled)
    for q in ("hello", "the capital of France?", "trains and tea"):
        text, st = s.reply(q)
        assert st.stop_reason == "stop", text
        jsonschema.validate(json.loads(text), REPLY_SCHEMA)
    assert compiled.masks == 0  # the compiled one is only ever copied


@pytest.mark.slow
def test_piped_chat_json_schema_on_the_real_model(real_bundle_int4, tmp_path):
    """`edgekv chat --json-schema` piped, --json and plain: every reply of a 3-turn conversation
    validates, /save and /load in between keep working."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(REPLY_SCHEMA))
    chat = tmp_path / "c.npz"
    talk = f"Tell me a joke.\n/save {chat}\nWhat is the capital of France?\n/load {chat}\nWrite a haiku about tea.\n"
    common = ("chat", real_bundle_int4, "--json-schema", schema, "--max-new-tokens", "60", "--threads", "2")
    r = run_edgekv(*common, "--json", input=talk)
    assert r.returncode == 0, r.stderr
    turns = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(turns) == 3 and "saved to" in r.stderr and "loaded" in r.stderr, r.stderr
    for t in turns:
        assert t["stop_reason"] == "stop"
        jsonschema.validate(json.loads(t["text"]), REPLY_SCHEMA)
    r = run_edgekv(*common, "--temperature", "0", input="Tell me a joke.\nAnother one.\nAnd a third.\n")
    assert r.returncode == 0, r.stderr
    replies = json.loads("[" + r.stdout.replace("}\n{", "},{") + "]")  # the replies, one after another
    assert len(replies) == 3
    for reply in replies:
        jsonschema.validate(reply, REPLY_SCHEMA)


def test_chat_json_schema_errors_are_one_line_at_start_up(tiny_bundle_int8, tmp_path, monkeypatch):
    from tests.conftest import cli

    pytest.importorskip("llguidance")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "not.json").write_text(json.dumps({"not": {"type": "string"}}))
    cases = [(tmp_path / "missing.json", "no such file"), (tmp_path / "bad.json", "not JSON"),
             (tmp_path / "not.json", 'Unimplemented keys: ["not"]'), (tmp_path, "not a regular file")]
    for path, said in cases:
        r = cli("chat", tiny_bundle_int8, "--json-schema", path, "--threads", "1", input="hello\n")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and said in lines[0] and not r.stdout, (path, r.stderr)
    (tmp_path / "ok.json").write_text(json.dumps(REPLY_SCHEMA))
    monkeypatch.setitem(sys.modules, "llguidance", None)  # not installed
    r = cli("chat", tiny_bundle_int8, "--json-schema", tmp_path / "ok.json", "--threads", "1", input="hello\n")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "needs llguidance" in lines[0], r.stderr
