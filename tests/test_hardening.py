"""Issue 12: nothing lost, nothing overwritten, one clear line for every bad input.

Safe writes (edgekv/format/files.py), export --out, transactional /load and prompt cache, chat
turns that are all or nothing (a real SIGINT in a multi-chunk prefill and in decode), the ring's
refusals, the manifest schema, verify, non-finite logits, bounded chat templates, check-trt on
non-ONNX files, flag ranges."""
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from edgekv.chat.session import ChatSession
from edgekv.errors import ContextOverflow, EdgeKVError, NonFinite
from edgekv.format import files
from edgekv.format.bundle import load_bundle
from edgekv.runtime.backends import OrtBackend
from edgekv.runtime.cache import KVCache
from edgekv.runtime.sampling import SamplingParams
from edgekv.runtime.text import TextCodec
from tests.conftest import ROOT, chat_engine, cli
from tests.test_cli_errors import assert_clean_error


def session(path, ctx=256, max_new=12, context="drop-turns", system="You are terse.", chunk=256):
    b = load_bundle(path)
    engine = chat_engine(OrtBackend(b, threads=1), b, ctx, chunk)
    return ChatSession(b, TextCodec(b), engine, SamplingParams(), system, max_new, context)


def state(s: ChatSession):
    """Everything a turn may change: the sequence, its cells' bytes, the pool, the messages."""
    seq = s.seq
    cells = {k: v.tobytes() for k, v in s.cache.read_cells(seq.cells).items()}
    return (seq.cells, seq.ids, seq.sinks), cells, s.batcher.pool.refs.tobytes(), json.dumps(s.messages), \
        s.dropped_turns


# -- safe writes -----------------------------------------------------------------------------

def test_save_refuses_to_replace_anything_but_a_regular_file(tiny_bundle_int8, tmp_path):
    s = session(tiny_bundle_int8)
    s.reply("Hi")
    fifo, folder, target = tmp_path / "fifo", tmp_path / "dir", tmp_path / "target.txt"
    os.mkfifo(fifo)
    folder.mkdir()
    target.write_text("keep")
    link = tmp_path / "link.npz"
    link.symlink_to(target)
    for path, kind in ((fifo, "FIFO"), (folder, "folder"), (link, "symbolic link")):
        with pytest.raises(EdgeKVError, match=kind):
            s.save(str(path))
    assert files.kind_of(fifo) == "a FIFO" and link.is_symlink() and target.read_text() == "keep"
    with pytest.raises(EdgeKVError, match="no folder"):
        s.save(str(tmp_path / "missing" / "c.npz"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "fifo", "link.npz", "target.txt"]  # no temp left


def test_concurrent_writes_of_one_file_do_not_collide(tmp_path):
    target = tmp_path / "out.json"
    payloads = [json.dumps({"writer": i, "pad": "x" * 200_000}) for i in range(8)]
    errors = []

    def write(text):
        try:
            files.write_text(target, text)
        except Exception as e:  # a shared temp name shows up as a missing or half-written file
            errors.append(e)

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and target.read_text() in payloads
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_export_refuses_a_folder_that_is_not_a_bundle_and_force_keeps_its_files(tiny_llama, tmp_path):
    from export.destination import check_out_dir, replaceable

    out = tmp_path / "x"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("keep")
    assert_clean_error(cli("export", tiny_llama, "--out", out, "--max-context", "64", "--steps", "2"),
                       "not an edgekv bundle")
    assert (out / "notes.txt").read_text() == "keep" and (out / "sub").is_dir()
    # --force: what export_bundle does once the new bundle passed its checks (a real export is slow)
    check_out_dir(out, force=True)
    new = tmp_path / "new"
    new.mkdir()
    (new / "edgekv.json").write_text(json.dumps({"format_version": 1}))
    kept = files.replace_dir(new, out, keep_old=not replaceable(out))
    assert kept is not None and (kept / "notes.txt").read_text() == "keep" and kept.name.startswith("x.old-")
    # an old bundle is replaced without --force, and nothing is left beside it
    check_out_dir(out, force=False)
    new.mkdir()
    assert files.replace_dir(new, out, keep_old=not replaceable(out)) is None and not any(out.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x", kept.name]
    link = tmp_path / "link"
    link.symlink_to(kept)
    with pytest.raises(EdgeKVError, match="symbolic link"):
        check_out_dir(link, force=True)


# -- transactional loads ---------------------------------------------------------------------

def test_failed_load_leaves_the_conversation_as_it_was(tiny_bundle_int8, tmp_path):
    s = session(tiny_bundle_int8)
    s.reply("What is the capital of France?")
    good = tmp_path / "good.npz"
    s.save(str(good))
    s.reply("And of Germany?")
    before = state(s)
    with np.load(good) as z:
        meta = json.loads(bytes(z["__meta__"]).decode())
        arrays = {k: z[k] for k in z.files if k != "__meta__"}

    def variant(name, meta_change=None, arrays_change=None):
        m, a = json.loads(json.dumps(meta)), dict(arrays)
        if meta_change:
            meta_change(m)
        if arrays_change:
            arrays_change(a)
        p = tmp_path / name
        np.savez(p, __meta__=np.frombuffer(json.dumps(m).encode(), np.uint8), **a)
        return p

    first = sorted(arrays)[0]
    bad = [tmp_path / "empty.npz", tmp_path / "truncated.npz",
           variant("no-messages.npz", lambda m: m.pop("messages")),
           variant("ids-outside-vocab.npz", lambda m: m["ids"].__setitem__(0, 10 ** 9)),
           variant("ids-vs-slots.npz", lambda m: m["ids"].pop()),
           variant("wrong-shape.npz", arrays_change=lambda a: a.__setitem__(first, a[first][..., :1])),
           variant("wrong-dtype.npz", arrays_change=lambda a: a.__setitem__(first, a[first].astype(np.float64))),
           variant("other-model.npz", lambda m: m.__setitem__("bundle_sha256", "0" * 64))]
    bad[0].write_bytes(b"")
    bad[1].write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for path in bad:
        with pytest.raises(EdgeKVError):
            s.load(str(path))
        assert state(s) == before, path.name
    s.load(str(good))
    assert len(s.messages) == 2


# -- chat turns are all or nothing -----------------------------------------------------------

def test_interrupted_decode_and_prefill_leave_the_conversation_exactly_as_before(tiny_bundle_int8):
    s = session(tiny_bundle_int8, max_new=40, chunk=8)
    s.reply("What is the capital of France?")
    before = state(s)

    def stop_after(n):
        seen = []

        def write(piece):
            seen.append(piece)
            if len(seen) == n:
                raise KeyboardInterrupt
        return write

    text, st = s.reply("Tell me about robots and trains.", stop_after(3))
    assert st.stop_reason == "interrupted" and text == "" and state(s) == before
    run, calls = s.batcher.backend.run_cells, []

    def interrupt_third_chunk(*a):
        calls.append(a[3].shape[1])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return run(*a)

    s.batcher.backend.run_cells = interrupt_third_chunk
    text, st = s.reply("Tell me about robots, trains and tea. " * 4)
    s.batcher.backend.run_cells = run
    assert calls[:2] == [8, 8] and st.stop_reason == "interrupted" and state(s) == before
    # and the next turn is the one a session that never saw the interrupted turns gives
    t = session(tiny_bundle_int8, max_new=40, chunk=8)
    t.reply("What is the capital of France?")
    assert s.reply("And of Germany?")[0] == t.reply("And of Germany?")[0]


@pytest.mark.parametrize("rows", [True, False], ids=["slot-ranges", "whole-cache"])
def test_interrupted_turn_in_a_wrapped_ring_puts_the_overwritten_cells_back(tiny_bundle_int8, rows, monkeypatch):
    """Host memory copies only the overwritten cells; a memory without row ranges, the whole cache."""
    if not rows:
        monkeypatch.setattr(KVCache, "reads_rows", property(lambda self: False))
    s = session(tiny_bundle_int8, ctx=64, max_new=16, context="ring", chunk=8)
    while not s.seq.wrapped:
        s.reply("Tell me about trains.")
    before = state(s)
    run, calls = s.batcher.backend.run_cells, []

    def interrupt_late(*a):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return run(*a)

    s.batcher.backend.run_cells = interrupt_late
    s.reply("What is the capital of France? Tell me about robots.")
    s.batcher.backend.run_cells = run
    assert state(s) == before


def test_ring_refuses_a_message_longer_than_the_ring_and_a_long_system_prompt(tiny_bundle_int8):
    s = session(tiny_bundle_int8, ctx=64, context="ring")
    s.reply("Hi")
    before = state(s)
    with pytest.raises(ContextOverflow, match="message too long"):
        s.reply("The capital of France is Paris. " * 20)
    assert state(s) == before
    with pytest.raises(ContextOverflow, match="system prompt too long"):
        session(tiny_bundle_int8, ctx=64, context="ring", system="Tell me about robots, trains and tea. " * 10)
    with pytest.raises(ContextOverflow, match="system prompt too long"):
        s.set_system("Tell me about robots, trains and tea. " * 10)
    assert state(s) == before and s.system == "You are terse."


def test_piped_chat_survives_every_recoverable_error(tiny_bundle_int8, tmp_path):
    (tmp_path / "empty.npz").write_bytes(b"")
    (tmp_path / "dir").mkdir()
    lines = [b"What is the capital of France?", b"The capital of France is Paris. " * 40, b"caf\xe9 \xff\xfe",
             f"/save {tmp_path}/missing/c.npz".encode(), f"/save {tmp_path}/dir".encode(),
             f"/load {tmp_path}/empty.npz".encode(), f"/load {tmp_path}/nothing.npz".encode(),
             b"And of Germany?"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "edgekv", "chat", tiny_bundle_int8, "--json", "--ctx", "128",
                        "--context", "drop-turns", "--temperature", "0", "--max-new-tokens", "8"],
                       input=b"\n".join(lines) + b"\n", capture_output=True, env=env, timeout=300, cwd=tmp_path)
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    errors = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(errors) == 6, err
    assert ["message too long" in errors[0], "UTF-8" in errors[1], "no folder" in errors[2], "folder" in errors[3],
            "empty.npz" in errors[4], "no such file" in errors[5]] == [True] * 6, errors
    turns = [json.loads(l) for l in r.stdout.decode().splitlines()]
    assert [t["user"] for t in turns] == ["What is the capital of France?", "And of Germany?"]
    # the conversation was kept: the second turn prefilled only its own message
    assert turns[1]["kv_cells"] > turns[0]["kv_cells"] + turns[1]["prompt_tokens"] - 1


def _sigint_chat(bundle, mode):
    """A real SIGINT (Ctrl-C on a pty) in the middle of a slow turn; then /stats and one more
    turn. Returns that turn's JSON record, the stats line's slots and the exit status."""
    pexpect = pytest.importorskip("pexpect")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = pexpect.spawn(sys.executable, [str(ROOT / "tests" / "sigint_chat.py"), str(bundle), "--json", "--ctx",
                                           "256", "--context", "drop-turns", "--temperature", "0",
                                           "--max-new-tokens", "60"],
                          env=env, cwd=str(ROOT), encoding="utf-8", timeout=120)
    try:
        child.sendline("What is the capital of France?")
        child.expect(r'"kv_cells": \d+')
        if mode == "prefill":  # about 120 tokens: 15 chunks of 8
            child.sendline("SLOW " + "Tell me about robots, trains and tea. " * 12)
            child.expect("CALL prefill 3")
        else:
            child.sendline("SLOW Tell me about robots.")
            child.expect("CALL decode 5")
        child.sendintr()  # the pty's Ctrl-C: SIGINT to the process
        child.expect(r'"stop_reason": "interrupted"')
        child.sendline("/stats")
        child.expect(r"KV \d+/256 cells")
        stats = child.after
        child.sendline("And of Germany?")
        child.expect(r'\{"user": "And of Germany\?"[^\r\n]*')
        out = json.loads(child.after)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    return out, stats, child.exitstatus


@pytest.fixture(scope="module")
def uninterrupted_chat(tiny_bundle_int8):
    """The oracle of the SIGINT tests: the same chat without the interrupted turn (its records)."""
    r = cli("chat", tiny_bundle_int8, "--json", "--ctx", "256", "--context", "drop-turns", "--temperature", "0",
            "--max-new-tokens", "60", input="What is the capital of France?\nAnd of Germany?\n")
    want = [json.loads(l) for l in r.stdout.splitlines()]
    assert want, (r.returncode, r.stderr[-3000:])
    return want


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_real_sigint_leaves_the_conversation_as_before_the_turn(tiny_bundle_int8, uninterrupted_chat, mode):
    log, stats, status = _sigint_chat(tiny_bundle_int8, mode)
    assert status == 0
    want = uninterrupted_chat
    assert stats == f"KV {want[0]['kv_cells']}/256 cells"
    got = log
    keys = ("text", "kv_cells", "position", "prompt_tokens")
    assert {k: got[k] for k in keys} == {k: want[1][k] for k in keys}


# -- the manifest, the files, the graph ------------------------------------------------------

MUTATIONS = {
    "huge n_layers": (lambda m: m["model"].__setitem__("n_layers", 10 ** 9), "model.n_layers"),
    "negative head_dim": (lambda m: m["model"].__setitem__("head_dim", -4), "model.head_dim"),
    "string max_context": (lambda m: m.__setitem__("max_context", "lots"), "max_context is str"),
    "missing nested key": (lambda m: m["model"].pop("n_kv_heads"), "missing model.n_kv_heads"),
    "bool as int": (lambda m: m["model"].__setitem__("vocab_size", True), "model.vocab_size"),
    "onnx outside": (lambda m: m["files"].__setitem__("onnx", "../model.onnx"), "not inside the bundle"),
    "absolute size key": (lambda m: m["files"]["sizes"].__setitem__("/etc/passwd", 1), "not inside the bundle"),
    "layers vs io": (lambda m: m["model"].__setitem__("n_layers", 3), "io does not match"),
    "vocab vs graph": (lambda m: m["model"].__setitem__("vocab_size", 500), "logits have 384"),
    "scheme vs graph": (lambda m: m["kv"].__setitem__("scheme", "int4"), "KV scheme int4 and dtype float32 need"),
    "bad template": (lambda m: m.__setitem__("chat_template", "{% for %}"), "bad chat template"),
    "stop id outside vocab": (lambda m: m["special"].__setitem__("stop_token_ids", [10 ** 6]), "stop_token_ids"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_manifest_mutations_are_one_line(bundle_copy, name):
    change, pattern = MUTATIONS[name]
    m = json.loads((bundle_copy / "edgekv.json").read_text())
    change(m)
    (bundle_copy / "edgekv.json").write_text(json.dumps(m))
    from edgekv.cli import main

    with pytest.raises(EdgeKVError, match=pattern):
        from edgekv.runtime.assemble import open_runtime

        open_runtime(bundle_copy, 16, "ort-cpu", 1).codec
    assert main(["generate", str(bundle_copy), "hi", "--max-new-tokens", "2"]) == 1


def test_symlink_out_of_the_bundle_is_refused(bundle_copy, tmp_path):
    outside = tmp_path / "tokenizer.json"
    shutil.move(bundle_copy / "tokenizer.json", outside)
    (bundle_copy / "tokenizer.json").symlink_to(outside)
    with pytest.raises(EdgeKVError, match="not inside the bundle"):
        load_bundle(bundle_copy)


def test_verify_finds_weights_changed_in_place_and_remembers_what_it_hashed(bundle_copy, monkeypatch, capsys):
    import edgekv.format.bundle as fb
    from edgekv.cli import main

    monkeypatch.setattr(fb, "RACY_NS", 0)  # the files were copied just now
    assert main(["verify", str(bundle_copy)]) == 0
    assert main(["verify", str(bundle_copy)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "(3 hashed now, 0 unchanged" in out[0] and "(0 hashed now, 3 unchanged" in out[1], out
    data = bundle_copy / "model.onnx.data"
    with open(data, "r+b") as f:  # zeros over part of the weights, same size: load cannot tell
        f.seek(1024)
        f.write(b"\0" * 8192)
    load_bundle(bundle_copy)
    assert_clean_error(cli("verify", bundle_copy), "model.onnx.data does not match its sha256")


def test_non_finite_logits_stop_with_one_line(bundle_copy):
    data = bundle_copy / "model.onnx.data"
    data.write_bytes(np.full(data.stat().st_size // 4, np.nan, np.float32).tobytes())
    assert_clean_error(cli("generate", bundle_copy, "hi", "--max-new-tokens", "4"), "non-finite logits")
    b = load_bundle(bundle_copy)
    from edgekv.runtime.assemble import Runtime

    with pytest.raises(NonFinite):  # its own type, as the batcher's: a caller (eval, bench) can tell it from other errors
        Runtime(b, OrtBackend(b, threads=1), 32).stream().prefill([5, 6, 7])


def test_chat_template_rendering_is_bounded(bundle_copy, monkeypatch):
    import edgekv.runtime.text as text

    monkeypatch.setattr(text, "MAX_RENDER_S", 0.5)
    monkeypatch.setattr(text, "MAX_RENDER_CHARS", 10_000)
    m = json.loads((bundle_copy / "edgekv.json").read_text())
    for template, pattern in (
            ("{% for i in range(1000) %}{% for j in range(1000) %}xx{% endfor %}{% endfor %}", "characters"),
            ("{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}", "longer than"),
            ("{{ ''.__class__.__mro__ }}", "chat template")):  # the sandbox still refuses
        m["chat_template"] = template
        (bundle_copy / "edgekv.json").write_text(json.dumps(m))
        codec = TextCodec(load_bundle(bundle_copy))
        with pytest.raises(EdgeKVError, match=pattern):
            codec.render([{"role": "user", "content": "hi"}])


def test_check_trt_on_empty_and_garbage_files(tmp_path):
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "garbage.onnx").write_bytes(os.urandom(4096))
    assert_clean_error(cli("check-trt", tmp_path / "empty.onnx"), "not an ONNX model")
    assert_clean_error(cli("check-trt", tmp_path / "garbage.onnx"), "not an ONNX model")


# -- flags -----------------------------------------------------------------------------------

BAD_FLAGS = [
    (["generate", "B", "hi", "--ctx", "0"], "--ctx: must be an integer in 1..4194304"),
    (["generate", "B", "hi", "--max-new-tokens", "-5"], "--max-new-tokens: must be an integer in 1.."),
    (["generate", "B", "hi", "--top-p", "2"], "--top-p: must be a number in (0, 1]"),
    (["generate", "B", "hi", "--top-k", "-3"], "--top-k: must be an integer in 0.."),
    (["generate", "B", "hi", "--temperature", "nan"], "--temperature: must be a number in [0, 100]"),
    (["generate", "B", "hi", "--seed", "-1"], "--seed: must be an integer in 0.."),
    (["chat", "B", "--repeat-penalty", "0"], "--repeat-penalty: must be a number in (0, 100]"),
    (["eval", "B", "--chunks", "0"], "--chunks: must be an integer in 1.."),
    (["eval", "B", "--stride", "-1"], "--stride: must be an integer in 1.."),
    (["bench", "B", "--repeat", "0"], "--repeat: must be an integer in 1..1000"),
    (["bench", "B", "--capacities", "32,x"], "--capacities: must be comma-separated integers"),
    (["eval-context", "B", "--turns", "0"], "--turns: must be an integer in 1..10000"),
    (["export", "--threads", "0"], "--threads: must be an integer in 1..1024"),
]


@pytest.mark.parametrize("argv,pattern", BAD_FLAGS, ids=[" ".join(a[:1] + a[-2:]) for a, _ in BAD_FLAGS])
def test_flags_out_of_range_are_one_line_with_the_range(argv, pattern, capsys):
    from edgekv.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and pattern in err, err


def test_safe_writes_never_touch_the_process_umask(tmp_path, monkeypatch):
    """Reading the umask means setting it (process-wide): a server thread creating a file meanwhile
    would make it world-writable. A new file still gets 0666 less the umask."""
    import os
    import stat

    from edgekv.format.files import write_bytes

    mask = os.umask(0o022)
    os.umask(mask)

    def no_umask(*a):
        raise AssertionError("os.umask called")

    monkeypatch.setattr(os, "umask", no_umask)
    write_bytes(tmp_path / "f.bin", b"x")
    (tmp_path / "g.bin").write_bytes(b"old")
    (tmp_path / "g.bin").chmod(0o600)
    write_bytes(tmp_path / "g.bin", b"new")  # replaced: the new file's mode, as before
    assert stat.S_IMODE((tmp_path / "f.bin").stat().st_mode) == 0o666 & ~mask
    assert stat.S_IMODE((tmp_path / "g.bin").stat().st_mode) == 0o666 & ~mask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin", "g.bin"]
