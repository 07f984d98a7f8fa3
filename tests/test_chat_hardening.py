"""Issue 22, the chat: nothing a user keeps is lost, Ctrl-C cancels a command and the chat goes on,
a saved chat loads only into the bundle whose weights made its KV cache, /stats tells the truth,
a foreign file is one line, and a chat template cannot exhaust memory (jinja's constant folding).

Oracles: the user's file byte for byte, the session's whole state (cells, ids, messages, the
cells' bytes) before and after, a reference session that loaded the file without interruption,
a plain jinja sandbox rendering the same template, and a separate chat run that never saw the
cancelled commands."""
import json
import os
import re
import signal
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from edgekv.chat import persistence, terminal
from edgekv.chat.session import ChatSession
from edgekv.errors import EdgeKVError
from edgekv.format.bundle import load_bundle
from edgekv.runtime.backends import OrtBackend
from edgekv.runtime.sampling import SamplingParams
from edgekv.runtime.text import TextCodec
from tests.conftest import CHAT_TEMPLATE, ROOT, chat_engine, interrupt_points, lines_run, run_edgekv

SYSTEM = "You are terse."
EXCEPTION_NAME = re.compile(r"\(\w+(Error|Exception)\)")  # "(ValueError)": a class name is not a message


def session(path, ctx=256, context="drop-turns", max_new=12):
    b = load_bundle(path)
    return ChatSession(b, TextCodec(b), chat_engine(OrtBackend(b, threads=1), b, ctx), SamplingParams(), SYSTEM,
                       max_new, context)


def command(s, line, capsys):
    """One slash command as the terminal runs it; its stderr lines (the chat must go on: no raise)."""
    capsys.readouterr()
    assert terminal.handle_command(s, line) is None
    return [l for l in capsys.readouterr().err.splitlines() if l.strip()]


def state(s: ChatSession):
    """Everything /load may change, exactly (cells and pool refs included)."""
    e, h = s.batcher, s.seq
    return dict(refs=e.pool.refs.tolist(), cells=h.cells, **content(s))


def content(s: ChatSession):
    """What the conversation is, whichever cells hold it."""
    h = s.seq
    return dict(ids=h.ids, sinks=h.sinks, n=h.n, system=s.system, msgs=json.dumps(s.messages),
                kv={k: v.tobytes() for k, v in s.batcher.snapshot(h).items()}, turn=s.batcher.kv.turns.current)


def rewrite_meta(src, dst, change):
    """A copy of a saved chat with its meta changed (written as `save` writes: __meta__ first)."""
    with np.load(src) as z:
        meta = json.loads(bytes(z["__meta__"]).decode())
        arrays = {k: z[k] for k in z.files if k != "__meta__"}
    change(meta)
    with open(dst, "wb") as f:
        np.savez(f, __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    return dst


@pytest.fixture(scope="module")
def tiny_bundle_w8(tiny_llama, tmp_path_factory):
    """The tiny model exported again with int8 weights: the same source sha256 as tiny_bundle_int8
    (float weights), the same KV scheme, another model.onnx.data."""
    from export.pipeline import export_bundle

    return export_bundle(str(tiny_llama), kv="int8", out=str(tmp_path_factory.mktemp("w8") / "tiny-w8"),
                         max_context=256, steps=8, weights="int8")


# -- 1. /save never replaces a file that is not a saved chat, unless /save! ------------------------

def test_save_refuses_to_replace_a_file_that_is_not_a_saved_chat(tiny_bundle_int8, tmp_path, capsys):
    s = session(tiny_bundle_int8)
    s.reply("What is the capital of France?")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as z:  # another program's zip: a zip, not ours
        z.writestr("a.txt", "hello")
    for p in (notes, other):
        before = p.read_bytes()
        err = command(s, f"/save {p}", capsys)
        assert len(err) == 1 and err[0].startswith("error:") and "not a saved edgekv chat" in err[0], err
        assert f"/save! {p}" in err[0], err  # says how to replace it on purpose
        assert p.read_bytes() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["notes.txt", "other.zip"]  # no temp file left
    # this conversation's saved chat and an empty file are replaced by a plain /save
    chat, empty = tmp_path / "c.npz", tmp_path / "empty.npz"
    s.save(str(chat))
    empty.write_bytes(b"")
    s.reply("And of Germany?")
    for p in (chat, empty):
        assert command(s, f"/save {p}", capsys) == [f"(saved to {p})"]
        t = session(tiny_bundle_int8)
        t.load(str(p))
        assert t.messages == s.messages and t.ids == s.ids
    # another conversation's saved chat is not (`/save c.npz` typed for `/load c.npz`), until it is loaded
    another = session(tiny_bundle_int8)
    before = chat.read_bytes()
    err = command(another, f"/save {chat}", capsys)
    assert len(err) == 1 and "another conversation's saved chat" in err[0] and f"/save! {chat}" in err[0], err
    assert chat.read_bytes() == before
    another.load(str(chat))
    another.reply("And of Spain?")
    assert command(another, f"/save {chat}", capsys) == [f"(saved to {chat})"]
    # /save! replaces a file that is not a saved chat, because the user said so
    assert command(s, f"/save! {notes}", capsys) == [f"(saved to {notes})"]
    t = session(tiny_bundle_int8)
    t.load(str(notes))
    assert t.messages == s.messages
    # ... but never a symlink or a folder
    link = tmp_path / "link.npz"
    link.symlink_to(other)
    err = command(s, f"/save! {link}", capsys)
    assert len(err) == 1 and "symbolic link" in err[0] and link.is_symlink()
    assert "/save! FILE" in terminal.HELP


# -- 5. a file that is not a saved chat is one clear line -------------------------------------------

def test_load_of_a_file_that_is_not_a_saved_chat_is_one_clear_line(tiny_bundle_int8, tmp_path, capsys):
    s = session(tiny_bundle_int8)
    s.reply("Hi")
    good = tmp_path / "good.npz"
    s.save(str(good))
    before = state(s)
    notes, other, npy, empty, cut = (tmp_path / n for n in ("notes.txt", "other.zip", "a.npy", "empty.npz",
                                                             "cut.npz"))
    notes.write_text("my notes\n")
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("a.txt", "hello")
    np.save(npy, np.zeros(3))
    empty.write_bytes(b"")
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for p in (notes, other, npy):
        assert command(s, f"/load {p}", capsys) == [f"error: {p}: not a saved edgekv chat"]
    for p in (empty, cut):  # ours, or nothing: say it is damaged, still one line, no exception class
        err = command(s, f"/load {p}", capsys)
        assert len(err) == 1 and err[0].startswith(f"error: {p}: ") and not EXCEPTION_NAME.search(err[0]), err
    assert state(s) == before


def test_piped_chat_keeps_a_users_file_and_refuses_a_foreign_load(tiny_bundle_int8, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    lines = ["What is the capital of France?", f"/save {notes}", f"/load {notes}", "And of Germany?"]
    r = run_edgekv("chat", tiny_bundle_int8, "--json", "--temperature", "0", "--max-new-tokens", "8",
                   input="\n".join(lines) + "\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 2 and "not a saved edgekv chat" in errors[0] and "/save!" in errors[0], errors
    assert errors[1] == f"error: {notes}: not a saved edgekv chat", errors
    assert notes.read_text() == "my notes\n"
    turns = [json.loads(l) for l in r.stdout.splitlines()]
    assert [t["user"] for t in turns] == [lines[0], lines[3]]
    assert turns[1]["kv_cells"] > turns[0]["kv_cells"]  # the conversation went on


# -- 2. Ctrl-C in /save or /load cancels the command; the chat goes on ---------------------------------

class LineInterrupt:
    """KeyboardInterrupt at the k-th line executed in the traced files (as tests/test_chat_engine.py
    does for a turn): Ctrl-C at every line of a command (every_line), one run per point."""

    def __init__(self, k, files):
        self.k, self.files, self.seen, self.where = k, files, 0, None

    def __call__(self, frame, event, arg):
        if self.where is None and frame.f_code.co_filename.endswith(self.files):
            return self.local
        return None

    def local(self, frame, event, arg):
        if self.where is not None:
            return None
        if event == "line":
            self.seen += 1
            if self.seen == self.k:
                self.where = (frame.f_code.co_filename.rsplit("/", 1)[-1], frame.f_lineno, frame.f_code.co_name)
                raise KeyboardInterrupt
        return self.local


def every_line(files, run):
    """Call run() with Ctrl-C at each of conftest's interrupt_points of `files` (from the lines
    one uninterrupted run ran there), then once more uninterrupted (the command's effect is left
    in place); yields each run's place (None: it ran whole) and what run returned, the first,
    uninterrupted run's too: the caller puts back what a whole command changed."""
    out, lines = lines_run(files, run)
    yield None, out
    for k in interrupt_points(lines):
        tr = LineInterrupt(k, files)
        sys.settrace(tr)
        try:
            out = run()
        except KeyboardInterrupt:  # escaped the command: the chat would end (exit 130)
            pytest.fail(f"Ctrl-C at {tr.where} ended the chat")
        finally:
            sys.settrace(None)
        yield tr.where, out
    run()


SAVE_FILES = ("edgekv/chat/persistence.py", "edgekv/chat/session.py", "edgekv/format/files.py",
              "numpy/lib/npyio.py", "numpy/lib/format.py", "/zipfile.py")
LOAD_FILES = ("edgekv/chat/persistence.py", "edgekv/chat/session.py", "edgekv/runtime/batching/batcher.py", "edgekv/runtime/batching/scheduler.py", "edgekv/runtime/batching/kv.py",
              "edgekv/runtime/batching/turns.py", "edgekv/runtime/batching/poolseq.py", "edgekv/runtime/batching/runner.py",
              "edgekv/runtime/batching/postprocess.py", "edgekv/runtime/batching/request.py", "edgekv/runtime/batching/plan.py",
              "edgekv/runtime/cache.py", "edgekv/runtime/pool.py", "numpy/lib/npyio.py", "/zipfile.py")


# a Ctrl-C inside zipfile.open leaves the zip a member it never closed: its __del__ complains (ignored)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_at_every_line_of_save_leaves_the_file_whole_and_the_chat_going(tiny_bundle_int8, tmp_path, capsys):
    s = session(tiny_bundle_int8)
    s.reply("Hi")
    target = tmp_path / "c.npz"
    s.save(str(target))  # an older save of this conversation: "unchanged" is visible
    old_bytes = target.read_bytes()
    s.reply("What is the capital of France?")
    before = state(s)
    cancelled = completed = 0
    for where, err in every_line(SAVE_FILES, lambda: command(s, f"/save {target}", capsys)):
        left = sorted(p.name for p in tmp_path.iterdir() if p.name != "c.npz")
        assert left == [], where  # no temp file left
        assert len(err) == 1, (where, err)
        if target.read_bytes() == old_bytes:
            assert "cancelled" in err[0] and str(target) in err[0], (where, err)
            cancelled += 1
        else:  # Ctrl-C came after the rename: the new file is whole, and the line says it was saved
            assert err == [f"(saved to {target})"], (where, err)
            t = session(tiny_bundle_int8)
            t.load(str(target))
            assert t.messages == s.messages and t.ids == s.ids, where
            target.write_bytes(old_bytes)
            completed += 1
        assert state(s) == before, where
    assert cancelled > 50, cancelled
    assert s.reply("And of Germany?")[0]  # the chat goes on


# a Ctrl-C that lands in a ZipFile's __del__ (np.load's archive, collected mid-command) is ignored
# there, as a real one would be: Python reports it as unraisable
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_ctrl_c_at_every_line_of_load_changes_nothing_or_loads_whole(tiny_bundle_int8, tmp_path, capsys):
    other = session(tiny_bundle_int8)
    other.set_system("Be brief.")  # another system prompt: other sinks, other messages, other ids
    other.reply("Tell me about trains and tea.")
    other.reply("Go on.")
    f = tmp_path / "other.npz"
    other.save(str(f))
    ref = session(tiny_bundle_int8)
    ref.load(str(f))
    loaded = content(ref)
    s = session(tiny_bundle_int8)
    s.reply("What is the capital of France?")
    mine = tmp_path / "mine.npz"
    s.save(str(mine))
    before = state(s)
    cancelled = done = 0
    for where, err in every_line(LOAD_FILES, lambda: command(s, f"/load {f}", capsys)):
        assert len(err) == 1, (where, err)
        if "cancelled" in err[0]:
            assert state(s) == before, (where, err)
            cancelled += 1
        else:
            assert err[0].startswith(f"(loaded {f}"), (where, err)
            assert content(s) == loaded, where
            s.load(str(mine))  # back to the conversation the next run interrupts
            assert content(s) == {k: v for k, v in before.items() if k not in ("refs", "cells")}
            before = state(s)
            done += 1
    assert cancelled > 50, cancelled
    assert content(s) == loaded  # the last run was not interrupted
    # the chat goes on: the same reply as a session that never saw the cancelled loads
    s.load(str(mine))
    t = session(tiny_bundle_int8)
    t.reply("What is the capital of France?")
    assert s.reply("And of Germany?")[0] == t.reply("And of Germany?")[0]


SLOW_CHAT = r'''
"""edgekv chat whose /save writes part of a file then waits, and whose /load waits half-way through
restoring the cells (after the conversation's own cells were given back): a real SIGINT lands there."""
import signal, sys, time
import numpy as np
from edgekv.cli import main
from edgekv.runtime.cache import KVCache

def slow_savez(f, **arrays):
    f.write(b"PK\x03\x04 half a file")
    f.flush()
    print("SAVING", file=sys.stderr, flush=True)
    time.sleep(120)

_write_cells = KVCache.write_cells
def slow_write_cells(self, cells, snap):
    if sys._getframe(1).f_code.co_name == "restore":
        print("RESTORING", file=sys.stderr, flush=True)
        time.sleep(120)
    return _write_cells(self, cells, snap)

signal.signal(signal.SIGINT, signal.default_int_handler)  # also where the test runner ignores SIGINT
np.savez = slow_savez
KVCache.write_cells = slow_write_cells
sys.exit(main(["chat", *sys.argv[1:]]))
'''


def test_real_sigint_in_save_and_load_cancels_them_and_the_chat_goes_on(tiny_bundle_int8, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    other = session(tiny_bundle_int8)
    other.reply("Tell me about trains.")
    saved = tmp_path / "other.npz"
    other.save(str(saved))
    script = tmp_path / "slow_chat.py"
    script.write_text(SLOW_CHAT)
    flags = ["--json", "--ctx", "256", "--context", "drop-turns", "--temperature", "0", "--max-new-tokens", "12"]
    child = pexpect.spawn(sys.executable, [str(script), str(tiny_bundle_int8), *flags], cwd=str(tmp_path),
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), encoding="utf-8", timeout=120)
    try:
        child.sendline("What is the capital of France?")
        child.expect(r'"kv_cells": (\d+)')
        slots = int(child.match.group(1))
        child.sendline("/save new.npz")
        child.expect("SAVING")
        child.kill(signal.SIGINT)
        child.expect(r"\(/save cancelled[^\r\n]*")
        child.sendline("/load other.npz")
        child.expect("RESTORING")
        child.kill(signal.SIGINT)
        child.expect(r"\(/load cancelled[^\r\n]*")
        child.sendline("/stats")
        child.expect(r"KV \d+/256 cells")
        stats = child.after
        child.sendline("And of Germany?")
        child.expect(r'\{"user": "And of Germany\?"[^\r\n]*')
        got = json.loads(child.after)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.npz", "slow_chat.py"]  # nothing half-written
    assert stats == f"KV {slots}/256 cells"
    r = run_edgekv("chat", tiny_bundle_int8, *flags, input="What is the capital of France?\nAnd of Germany?\n")
    want = [json.loads(l) for l in r.stdout.splitlines()]
    keys = ("text", "kv_cells", "position", "prompt_tokens")
    assert {k: got[k] for k in keys} == {k: want[1][k] for k in keys}


# -- 3. a chat or prompt cache loads only into the bundle whose weights made its KV ------------------

def test_a_chat_saved_with_other_weights_is_refused_naming_the_difference(tiny_bundle_int8, tiny_bundle_w8, tmp_path):
    f = tmp_path / "c.npz"
    a = session(tiny_bundle_int8)
    a.reply("What is the capital of France?")
    a.save(str(f))
    b = session(tiny_bundle_w8)
    assert b.bundle.manifest["source"]["sha256"] == a.bundle.manifest["source"]["sha256"]  # the same model
    b.reply("Hello")
    before = state(b)
    with pytest.raises(EdgeKVError) as e:
        b.load(str(f))
    msg = str(e.value)
    assert "\n" not in msg and "float weights" in msg and "int8 weights" in msg, msg
    assert state(b) == before
    # the prompt cache: stale for this bundle, rebuilt (never restored), then restored
    pc = tmp_path / "sys.npz"
    assert "saved" in session(tiny_bundle_int8).warm_system(str(pc))
    note = session(tiny_bundle_w8).warm_system(str(pc))
    assert "restored" not in note and "saved" in note, note
    assert "restored" in session(tiny_bundle_w8).warm_system(str(pc))


GRAPH_CHANGES = {
    "group": (lambda m: m["weights"].update(format="int4", group=64), ["int4 weights (group 64)"]),
    "data file": (lambda m: m["files"]["sha256"].__setitem__("model.onnx.data", "ab" * 32),
                  ["model.onnx.data", "sha256"]),
    "dtype": (lambda m: m.__setitem__("dtype", "float16"), ["float16"]),
}


@pytest.mark.parametrize("what", GRAPH_CHANGES)
def test_each_thing_that_decides_the_kv_values_is_compared(tiny_bundle_int8, bundle_copy, tmp_path, what):
    """A bundle whose manifest differs in one thing that decides the KV values (the files are the
    same: only the record differs, which is all a load compares)."""
    change, words = GRAPH_CHANGES[what]
    f = tmp_path / "c.npz"
    a = session(tiny_bundle_int8)
    a.reply("Hi")
    a.save(str(f))
    man = json.loads((bundle_copy / "edgekv.json").read_text())
    change(man)
    b = load_bundle(bundle_copy)
    b.manifest = man  # load_bundle would refuse a float16 record over float32 files; the check reads the record
    s = ChatSession(b, TextCodec(b), chat_engine(OrtBackend(load_bundle(bundle_copy), threads=1), b, 256),
                    SamplingParams(), SYSTEM, 8, "drop-turns")
    with pytest.raises(EdgeKVError) as e:
        s.load(str(f))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_file_from_before_the_weights_record_is_refused_unless_load_bang(tiny_bundle_int8, tmp_path, capsys):
    """Safety first: a file that does not say which weights made its KV may be from another bundle
    of the same model; /load refuses it with one line, /load! FILE takes it on the user's word,
    and a prompt cache without the record is rebuilt."""
    a = session(tiny_bundle_int8)
    a.reply("What is the capital of France?")
    f = tmp_path / "c.npz"
    a.save(str(f))
    old = rewrite_meta(f, tmp_path / "old.npz", lambda m: m.pop("kv_origin"))
    s = session(tiny_bundle_int8)
    before = state(s)
    err = command(s, f"/load {old}", capsys)
    assert len(err) == 1 and "older edgekv" in err[0] and f"/load! {old}" in err[0], err
    assert state(s) == before
    assert command(s, f"/load! {old}", capsys)[0].startswith(f"(loaded {old}")
    assert s.messages == a.messages and s.ids == a.ids
    pc = tmp_path / "sys.npz"
    session(tiny_bundle_int8).warm_system(str(pc))
    rewrite_meta(pc, pc, lambda m: m.pop("kv_origin"))
    assert "saved" in session(tiny_bundle_int8).warm_system(str(pc))  # rebuilt, not trusted
    assert "restored" in session(tiny_bundle_int8).warm_system(str(pc))


# -- 4. /stats after /load and after a stopped turn -----------------------------------------------------

def test_stats_after_load_and_after_a_stopped_turn(tiny_bundle_int8, tmp_path):
    s = session(tiny_bundle_int8, max_new=20)
    s.reply("What is the capital of France?")
    first = s.last
    assert first.prompt_tokens > 0 and first.new_tokens > 0

    def stop_after_two(piece, seen=[]):
        seen.append(piece)
        if len(seen) == 2:
            raise KeyboardInterrupt

    assert s.reply("Tell me about robots and trains.", stop_after_two)[1].stop_reason == "interrupted"
    line = terminal.session_stats(s)  # the last completed turn's numbers, not zeros
    assert f"prefill {first.prompt_tokens} tok" in line and f"decode {first.new_tokens} tok" in line, line
    f = tmp_path / "c.npz"
    s.save(str(f))
    t = session(tiny_bundle_int8)
    t.load(str(f))
    line = terminal.session_stats(t)
    n, mib = s.seq.n, 2 ** 20
    assert "no turn yet since /load" in line, line
    assert f"KV {n}/256 cells, {t.cache.used_bytes(n) / mib:.2f} / {t.cache.nbytes / mib:.2f} MiB" in line, line
    assert "TTFT" not in line and "0.0 tok/s" not in line, line
    _, st = t.reply("And of Germany?")
    assert f"decode {st.new_tokens} tok" in terminal.session_stats(t)


# -- 6. a chat template cannot exhaust memory through jinja's constant folding ----------------------------

RENDER_CHILD = r'''
import resource, sys
from concurrent.futures import ThreadPoolExecutor
from edgekv.errors import EdgeKVError
from edgekv.format.bundle import load_bundle
from edgekv.runtime.text import TextCodec

b = load_bundle(sys.argv[1])
TextCodec(b).render([{"role": "user", "content": "hi"}])  # the libraries' own memory, before the limit
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
limit = vm + (768 << 20)  # a broken guard fails with MemoryError here instead of taking the machine
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
b.manifest["chat_template"] = sys.argv[2]


def render():  # in a worker thread, as a server renders: no SIGALRM there, only the checks
    return TextCodec(b).render([{"role": "user", "content": "hi"}])


try:
    with ThreadPoolExecutor(1) as pool:
        print("RENDERED", pool.submit(render).result()[:40])
except EdgeKVError as e:
    print("ERROR", str(e))
except MemoryError:
    print("MEMORY")
'''

HOSTILE_TEMPLATES = {
    "set folded": "{% set x = 'ab' * 1000000000 %}{{ messages[0]['content'] }}",
    "output folded": "{{ 'ab' * 10**9 }}",
    "power folded": "{{ 'ab' * (10**9 // 1) }}",
    "runtime product": "{% set n = (messages | length) * 1000000000 %}{{ 'ab' * n }}",
    "list product": "{% set x = [0] * 1000000000 %}{{ x | length }}",
    "huge power": "{{ 7 ** (10 ** 9) }}",
    "percent width": "{{ '%1000000000s' % 'a' }}",
    "center filter": "{{ 'a' | center(1000000000) }}",
    "str method": "{{ 'a'.ljust(1000000000) }}",
    "format width": "{{ '{:>1000000000}'.format('a') }}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
                "{{ ns.s | length }}",
    "concat doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s | length }}",
    "range": "{% for i in range(10**9) %}x{% endfor %}",
    "squaring": "{% set ns = namespace(x=10) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}"
                "{{ ns.x > 0 }}",
    "list output": "{% set big = 'a' * 4000000 %}{{ [big, big, big, big] }}",
    "join filter": "{% set big = 'a' * 4000000 %}{{ [big, big, big] | join('x') | length }}",
    "replace filter": "{% set s = 'a' * 100000 %}{{ s | replace('a', s) | length }}",
    "indent filter": "{% set s = '\n' * 1000000 %}{{ s | indent(1000) | length }}",
    "batch fill": "{{ [1] | batch(1000000000, 'x') | list }}",
    "slice filter": "{{ [1] | slice(1000000000) | list }}",
    "tojson indent": "{{ [1, 2] | tojson(indent=1000000000) }}",
    "str replace": "{% set s = 'a' * 100000 %}{{ s.replace('a', s) | length }}",
    "lipsum": "{{ lipsum(1000000000) }}",
}


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_hostile_chat_template_fails_fast_with_one_line(tiny_bundle_int8, name):
    r = subprocess.run([sys.executable, "-c", RENDER_CHILD, str(tiny_bundle_int8), HOSTILE_TEMPLATES[name]],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    out = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(out) == 1 and out[0].startswith("ERROR chat template"), (r.stdout, r.stderr[-2000:])


RICH_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n{{ 'Be ' ~ 'kind' | upper }}<|im_end|>\n{% endif %}"
    "{% set ns.n = ns.n + 1 %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
    "{{ ' ' * 2 }}{{ '%02d' % ns.n }}{{ 2 ** 5 }}{{ '{:>4}'.format(loop.index) }}{{ [1, 2] * 2 }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ 'x' | center(5) }}|")


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RICH_TEMPLATE], ids=["tiny", "rich"])
def test_a_normal_chat_template_renders_as_plain_jinja_does(bundle_copy, template):
    import jinja2.sandbox

    man = json.loads((bundle_copy / "edgekv.json").read_text())
    man["chat_template"] = template
    (bundle_copy / "edgekv.json").write_text(json.dumps(man))
    codec = TextCodec(load_bundle(bundle_copy))
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain = env.from_string(template)
    for msgs in ([{"role": "user", "content": "hi "}],
                 [{"role": "system", "content": "S"}, {"role": "user", "content": "Café 東京"},
                  {"role": "assistant", "content": "ok"}]):
        for gen in (True, False):
            want = plain.render(messages=msgs, add_generation_prompt=gen, bos_token=codec.special.get("bos_token") or "",
                                eos_token=codec.special.get("eos_token") or "")
            assert codec.render(msgs, gen) == want


def test_one_render_ending_does_not_lift_anothers_deadline(bundle_copy):
    """A server renders on worker threads (no SIGALRM there): the time bound is each render's own.
    A template that loops through attribute lookups for hours is stopped by its deadline even
    while other renders on other threads start and end."""
    import threading
    import time

    from edgekv.runtime import text

    man = json.loads((bundle_copy / "edgekv.json").read_text())
    man["chat_template"] = ("{% if messages[0]['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}"
                            "{% if j.real < 0 %}x{% endif %}{% endfor %}{% endfor %}{% else %}ok{% endif %}")
    (bundle_copy / "edgekv.json").write_text(json.dumps(man))
    codec = TextCodec(load_bundle(bundle_copy))
    result = []

    def hostile():
        try:
            codec.render([{"role": "user", "content": "loop"}])
            result.append("rendered")
        except EdgeKVError as e:
            result.append(str(e))

    t = threading.Thread(target=hostile, daemon=True)
    t.start()
    started = time.monotonic()
    while t.is_alive() and time.monotonic() - started < 6 * text.MAX_RENDER_S:
        assert codec.render([{"role": "user", "content": "hi"}]) == "ok"  # others start and end meanwhile
        t.join(0.05)
    assert result and "took longer than" in result[0], result
