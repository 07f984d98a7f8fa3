"""Issue 41 item 3: a full disk anywhere edgekv writes is one line naming the path and the bytes
needed, nothing half-written, no temporary left; the temporaries of a write killed mid-way are
removed at the next write to that folder (edgekv's own names only, never one a live writer holds).

A full disk three ways: a real tmpfs of a few hundred KiB (root only: skipped where it cannot be
mounted), ENOSPC raised at the Nth byte by a stand-in file (anyone), and RLIMIT_FSIZE in a
subprocess (EFBIG, anyone)."""
import errno
import io
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edgekv.errors import EdgeKVError
from edgekv.format import files
from tests.conftest import ROOT, cli

LEFTOVER = ".c.npz.0123456789ab.tmp"  # atomic_open's temporary: .NAME.<12 hex>.tmp
STAGING = ".B.tmp-k3x_9q0a"  # export's: .OUT.tmp-<8 of mkdtemp's alphabet>


@pytest.fixture
def small_disk(tmp_path):
    """make(bytes) -> a real file system of that size (a tmpfs), unmounted after the test."""
    mounts = []

    def make(size: int) -> Path:
        mnt = tmp_path / f"disk{len(mounts)}"
        mnt.mkdir()
        if not shutil.which("mount"):
            pytest.skip("no mount command")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounts.append(mnt)
        return mnt

    yield make
    for m in mounts:
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


def one_line(e: BaseException, path, *words) -> str:
    msg = str(e)
    assert "\n" not in msg and str(path) in msg and "needs at least" in msg and "bytes" in msg, msg
    assert all(w in msg for w in words), msg
    return msg


def fill(folder: Path) -> None:
    """Write until the disk is full (a user's file, not edgekv's)."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC


# -- files.py: the one place every write goes through ---------------------------------------

def test_a_write_onto_a_full_disk_is_one_line_and_the_old_file_stays(small_disk):
    disk = small_disk(256 * 1024)
    target = disk / "out.json"
    target.write_text("old")
    with pytest.raises(EdgeKVError) as e:  # size known: refused before anything is written
        files.write_bytes(target, b"x" * 400_000)
    one_line(e.value, target, "400,000 bytes", "free in")
    fill(disk)
    with pytest.raises(EdgeKVError) as e:  # size unknown: the disk fills up half-way
        with files.atomic_open(target, "wb") as f:
            for _ in range(100):
                f.write(b"y" * 10_000)
    one_line(e.value, target, "no space left")
    assert target.read_text() == "old" and sorted(p.name for p in disk.iterdir()) == ["filler", "out.json"]


class Filling(io.FileIO):
    """A file on a disk with `room` bytes left: the write that crosses it writes what fits and
    raises ENOSPC, as write(2) does."""
    room = 0

    def write(self, b):
        b = memoryview(b).cast("B")
        left = Filling.room - self.tell()
        if len(b) > left:
            if left > 0:
                super().write(b[:left])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(b)


@pytest.fixture
def room_for(monkeypatch):
    """room_for(n): every file os.fdopen opens for writing holds only n bytes (no root needed)."""
    real = os.fdopen

    def fdopen(fd, mode="r", buffering=-1, encoding=None, newline=None, **kw):
        if "w" not in mode:
            return real(fd, mode, buffering, encoding=encoding, newline=newline, **kw)
        buf = io.BufferedWriter(Filling(fd, "w"), 8192)
        return buf if "b" in mode else io.TextIOWrapper(buf, encoding=encoding or "utf-8", newline=newline)

    def set_room(n):
        Filling.room = n
        monkeypatch.setattr(os, "fdopen", fdopen)

    return set_room


def test_enospc_at_the_nth_byte_is_one_line_with_no_temporary_left(tmp_path, room_for):
    target = tmp_path / "table.csv"
    target.write_text("old")
    room_for(25_000)
    with pytest.raises(EdgeKVError) as e:
        with files.atomic_open(target, "w", newline="") as f:
            for i in range(5000):
                f.write(f"{i},row\n")
    one_line(e.value, target, "no space left")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["table.csv"]


def test_a_disk_full_error_inside_a_librarys_cleanup_error_is_still_one_line(tmp_path, room_for):
    """A library may raise its own error while it cleans up after the failed write (zipfile's
    "Can't close the ZIP file while there is an open writing handle"): the OSError is its context."""
    import numpy as np

    room_for(50_000)
    for name in ("c.npz", "d.npz"):
        target = tmp_path / name
        with pytest.raises(EdgeKVError) as e:
            with files.atomic_open(target, "wb") as f:
                if name == "c.npz":
                    np.savez(f, a=np.zeros(100_000, np.float32))
                else:
                    try:
                        f.write(b"x" * 100_000)
                        f.flush()
                    finally:
                        raise ValueError("Can't close the ZIP file while there is an open writing handle on it.")
        one_line(e.value, target, "no space left")
    assert list(tmp_path.iterdir()) == []


EFBIG_WRITER = """
import resource, sys
from edgekv.errors import EdgeKVError
from edgekv.format import files
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
for streamed in (False, True):
    try:
        if streamed:
            with files.atomic_open(sys.argv[1], "wb") as f:
                for _ in range(30):
                    f.write(b"x" * 10_000)
        else:
            files.write_bytes(sys.argv[1], b"x" * 300_000)
    except EdgeKVError as e:
        print(e)
"""


def test_the_file_size_limit_is_one_line_naming_the_limit(tmp_path):
    target = tmp_path / "bench.json"
    target.write_text("old")
    r = subprocess.run([sys.executable, "-c", EFBIG_WRITER, str(target)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, timeout=120)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and "Traceback" not in r.stderr and len(lines) == 2, (r.stdout, r.stderr)
    for line in lines:
        assert str(target) in line and "too large" in line and "ulimit -f" in line and "100,000 bytes" in line, line
    assert "300,000 bytes" in lines[0]  # known beforehand: refused before writing
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["bench.json"]


def test_json_output_into_a_folder_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "mkdir", full)
    with pytest.raises(EdgeKVError) as e:
        files.write_json(tmp_path / "runs" / "r.json", {"a": 1})
    assert str(tmp_path / "runs") in str(e.value) and "no space left" in str(e.value)


# -- leftovers of killed writes ----------------------------------------------------------------

def test_leftovers_are_removed_at_the_next_write_and_nothing_else_is(tmp_path, capsys):
    d = tmp_path
    (d / LEFTOVER).write_bytes(b"half a chat")
    (d / STAGING).mkdir()
    (d / STAGING / "model.onnx.data").write_bytes(b"half a bundle")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("keep")
    decoys = {  # names edgekv never writes, or not a regular file by that name
        ".c.npz.0123456789AB.tmp": "file", ".c.npz.0123456789a.tmp": "file", "c.npz.0123456789ab.tmp": "file",
        ".c.npz.0123456789ab.tmp.bak": "file", ".B.tmp-k3x_9q0": "dir", ".B.tmp-K3X_9Q0A": "dir",
        ".x.abcdefabcdef.tmp": "dir", ".B.tmp-abcdefgh": "file", ".l.0123456789ab.tmp": "link",
        ".L.tmp-abcdefgh": "link",
    }
    for name, kind in decoys.items():
        if kind == "file":
            (d / name).write_text("a user's")
        elif kind == "dir":
            (d / name).mkdir()
        else:
            (d / name).symlink_to(outside)
    hard = d / ".h.0123456789ab.tmp"  # a second name of a user's file
    os.link(outside, hard)
    theirs = d / ".U.tmp-abcd1234"  # named like export's, but holding a folder: edgekv never made it
    (theirs / "sub").mkdir(parents=True)
    (theirs / "notes.txt").write_text("a user's")
    capsys.readouterr()
    files.write_text(d / "out.json", "{}")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert sorted(p.name for p in d.iterdir()) == sorted([*decoys, hard.name, theirs.name, "out.json"])
    assert outside.read_text() == "keep" and all((d / n).is_symlink() for n, k in decoys.items() if k == "link")
    assert (theirs / "notes.txt").read_text() == "a user's" and (theirs / "sub").is_dir()
    assert len(err) == 2 and "removed 2 leftover" in err[0] and LEFTOVER in err[0] and STAGING in err[0], err
    assert hard.name in err[1] and "hard links" in err[1] and f"{theirs.name} (it holds what edgekv" in err[1], err


def test_a_temporary_being_written_is_not_a_leftover(tmp_path):
    """Another write to the same folder while one is in progress (a second chat, serve's bench)
    leaves its temporary alone: the writer holds a lock on it, which a kill -9 would release."""
    with files.atomic_open(tmp_path / "a.json", "w") as f:
        f.write("first")
        files.write_text(tmp_path / "b.json", "second")
        with files.temp_dir(tmp_path / "B") as staging:
            files.write_text(tmp_path / "c.json", "third")
            assert staging.is_dir()
    assert (tmp_path / "a.json").read_text() == "first" and (tmp_path / "b.json").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json", "c.json"]


def test_another_users_leftover_is_named_not_removed(tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a file away")
    (tmp_path / LEFTOVER).write_text("theirs")
    os.chown(tmp_path / LEFTOVER, 4321, 4321)
    files.write_text(tmp_path / "out.json", "{}")
    err = capsys.readouterr().err
    assert (tmp_path / LEFTOVER).read_text() == "theirs" and LEFTOVER in err and "another user's" in err


def test_removing_a_killed_writes_leftover_makes_the_room_it_took(small_disk):
    disk = small_disk(512 * 1024)
    (disk / STAGING).mkdir()
    with open(disk / STAGING / "model.onnx.data", "wb") as f:  # a killed export's half bundle fills the disk
        f.write(b"\0" * (500 * 1024))
    files.write_bytes(disk / "out.bin", b"z" * 300_000)
    assert sorted(p.name for p in disk.iterdir()) == ["out.bin"]


def chat(bundle):
    from edgekv.chat.session import ChatSession
    from edgekv.format.bundle import load_bundle
    from edgekv.runtime.backends import OrtBackend
    from edgekv.runtime.sampling import SamplingParams
    from edgekv.runtime.text import TextCodec
    from tests.conftest import chat_engine

    b = load_bundle(bundle)
    return ChatSession(b, TextCodec(b), chat_engine(OrtBackend(b, threads=1), b, 256), SamplingParams(), "Be brief.",
                       8, "drop-turns")


KILLED_SAVE = """
import sys, time
import numpy.lib.format as fmt
from tests.test_disk_full import chat

s = chat(sys.argv[1])
s.reply("Hi")
real = fmt.write_array

def stuck(fp, array, *a, **k):  # the first array half-written, then wait for the kill
    real(fp, array, *a, **k)
    print("saving", flush=True)
    time.sleep(300)

fmt.write_array = stuck
s.save(sys.argv[2])
"""


def test_kill_9_during_save_leaves_a_temporary_that_the_next_save_removes(tiny_bundle_int8, tmp_path, capsys):
    target = tmp_path / "c.npz"
    p = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(tiny_bundle_int8), str(target)], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "saving"
        left = [q.name for q in tmp_path.iterdir()]
        assert len(left) == 1 and re.fullmatch(r"\.c\.npz\.[0-9a-f]{12}\.tmp", left[0]), left
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(60)
    assert [q.name for q in tmp_path.iterdir()] == left  # what kill -9 leaves
    s = chat(tiny_bundle_int8)
    s.reply("Hi")
    capsys.readouterr()
    s.save(str(tmp_path / "other.npz"))
    err = capsys.readouterr().err
    assert [q.name for q in tmp_path.iterdir()] == ["other.npz"]
    assert err.count("\n") == 1 and "removed 1 leftover" in err and left[0] in err, err


def test_save_and_the_prompt_cache_on_a_full_disk(tiny_bundle_int8, small_disk):
    disk = small_disk(64 * 1024)
    s = chat(tiny_bundle_int8)
    (disk / "c.npz").write_bytes(b"")  # an empty file of ours: replaceable
    fill(disk)
    said = s.warm_system(str(disk / "system.npz"))  # a cache: the chat goes on without it
    assert "not saved" in said and str(disk / "system.npz") in said and "needs at least" in said, said
    s.reply("Hi")
    with pytest.raises(EdgeKVError) as e:
        s.save(str(disk / "c.npz"))
    one_line(e.value, disk / "c.npz", "no space left")
    assert sorted(p.name for p in disk.iterdir()) == ["c.npz", "filler"] and (disk / "c.npz").read_bytes() == b""


# -- export and engines ------------------------------------------------------------------------

def export_cli(src, out, *extra):
    return cli("export", src, "--out", out, "--max-context", "64", "--steps", "2", *extra)


def assert_one_error_line(r, *words):
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and all(w in errors[0] for w in words), r.stderr
    return errors[0]


def test_export_onto_a_full_disk_fails_before_the_long_steps_in_one_line(tiny_llama, small_disk):
    disk = small_disk(256 * 1024)  # the tiny model's float32 weights alone are ~440 KB
    (disk / STAGING).mkdir()  # a killed export's leftover there: removed on the way
    r = export_cli(tiny_llama, disk / "B", "--kv", "int8-static")
    line = assert_one_error_line(r, str(disk / "B"), "no space left", "needs at least", "free in")
    assert "loading: done" in r.stderr and "calibrating" not in r.stderr and "exporting ONNX" not in r.stderr, \
        r.stderr  # refused once the source is read, before the long steps
    assert list(disk.iterdir()) == [], line


def test_export_whose_disk_fills_while_writing_leaves_nothing(tiny_llama, small_disk, monkeypatch):
    disk = small_disk(256 * 1024)
    monkeypatch.setattr(files, "free_bytes", lambda folder: 1 << 40, raising=False)  # the check is fooled (a quota, say)
    r = export_cli(tiny_llama, disk / "B")
    assert_one_error_line(r, str(disk / "B"), "no space left", "needs at least")
    assert list(disk.iterdir()) == []


def test_an_engine_that_does_not_fit_is_one_line_and_the_old_engine_stays(bundle_copy, monkeypatch):
    from tests import fake_gpu

    fake_gpu.install(monkeypatch)
    from jetson.build_engine import build_engine

    folder = build_engine(str(bundle_copy), ctx=32, max_prefill=8)
    plan = (folder / "model.plan").read_bytes()
    (folder.parent / f".{folder.name}.tmp-abcd1234").mkdir()  # a killed build's
    monkeypatch.setattr(files, "free_bytes", lambda f: 1000, raising=False)
    with pytest.raises(EdgeKVError) as e:
        build_engine(str(bundle_copy), ctx=32, max_prefill=8, force=True)
    one_line(e.value, folder, "1,000 bytes free")
    assert (folder / "model.plan").read_bytes() == plan
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]


def test_eval_outputs_on_a_full_disk_are_one_line(small_disk):
    from edgekv.tools.evaluate import write_outputs

    disk = small_disk(64 * 1024)
    fill(disk)
    res = {"results": [{"name": "int8", "kld_mean": 0.1}], "pad": "x" * 10_000}
    with pytest.raises(EdgeKVError) as e:
        write_outputs(res, str(disk / "eval.json"), None)
    one_line(e.value, disk / "eval.json", "no space left")
    assert [p.name for p in disk.iterdir()] == ["filler"]
