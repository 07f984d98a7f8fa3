"""Property-based (hypothesis): mutated manifests, bundle files, saved chats, chat input and
command lines. Every run ends with a correct result, or a non-zero exit with exactly one line
and no traceback (an exception other than the CLI's own would fail the test); and no file outside
the test's tmp folder changes. Run with --hypothesis-show-statistics to see the case counts."""
import contextlib
import io
import json
import os
import shutil
import sys

import numpy as np
import pytest

# hypothesis is in the test extra; without it this suite is skipped, visibly
pytest.importorskip("hypothesis", reason="the fuzz suite needs hypothesis (pip install -e '.[test]')")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgekv.cli import build_parser, main
from edgekv.errors import EdgeKVError
from tests.conftest import ROOT, chat_engine

FUZZ = settings(max_examples=int(os.environ.get("EDGEKV_FUZZ_EXAMPLES", 40)), deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
COUNTS: dict[str, int] = {}  # cases run per property (printed at the end of the module; pytest -s shows it)
FILES = ("edgekv.json", "model.onnx", "model.onnx.data", "tokenizer.json")


def count(name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1


def run(argv, stdin: bytes | None = None):
    """cli.main in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in argv])
            except SystemExit as e:  # argparse
                rc = e.code
    finally:
        sys.stdin = old_stdin
    return rc, out.getvalue(), err.getvalue()


def assert_ok_or_one_line(rc, err):
    assert "Traceback" not in err, err
    if rc != 0:
        lines = [l for l in err.splitlines() if l.strip()]
        assert len(lines) == 1 and "error" in lines[0], err


def snapshot(*folders):
    """(path, size, mtime) of every file under the folders (caches excluded: .test-cache is where
    another worker of the run may be exporting the real model meanwhile, tests/conftest.py)."""
    skip = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".test-cache"}
    out = set()
    for folder in folders:
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = [d for d in dirnames if d not in skip]
            for f in filenames:
                p = os.path.join(dirpath, f)
                st_ = os.lstat(p)
                out.add((p, st_.st_size, st_.st_mtime_ns))
    return out


@pytest.fixture(scope="module")
def work(tiny_bundle_int8, tmp_path_factory):
    """A copy of the tiny bundle to mutate, the baseline answer, and a check that nothing outside
    the tmp folders changed over the whole module."""
    before = snapshot(ROOT, tiny_bundle_int8)
    base = tmp_path_factory.mktemp("fuzz")
    b = base / "b"
    shutil.copytree(tiny_bundle_int8, b)
    cwd = os.getcwd()
    os.chdir(base)  # relative paths a command writes land here
    rc, out, err = run(GENERATE(b))
    assert rc == 0, err
    yield {"bundle": b, "orig": tiny_bundle_int8, "base": base, "answer": out}
    os.chdir(cwd)
    assert snapshot(ROOT, tiny_bundle_int8) == before
    print(f"\nfuzz cases: {COUNTS} ({sum(COUNTS.values())} in all)")


def GENERATE(b):
    return ["generate", b, "What is the capital of France?", "--max-new-tokens", "4", "--ctx", "32", "--threads", "1",
            "--temperature", "0"]  # greedy: the tiny model records no sampling defaults (OpenAI's 1.0 then)


def restore(work):
    for f in FILES:
        shutil.copyfile(work["orig"] / f, work["bundle"] / f)


# -- manifests -------------------------------------------------------------------------------

def paths(node, prefix=()):
    """Every key path in a JSON tree (list items by index, the first three)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield prefix + (k,)
            yield from paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):
            yield prefix + (i,)
            yield from paths(v, prefix + (i,))


JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 600),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["../model.onnx", "/etc/passwd", "model.onnx", "tokenizer.json", "", "int4", "float16", "float",
                     "{% for %}", "{{ messages[0]['content'] * 100000 }}"]),
    st.lists(st.integers(-5, 10**6), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
# keys whose change may legitimately change the answer
OUTPUT_KEYS = ("special", "chat_template", "sampling")


@st.composite
def manifest_mutations(draw, manifest):
    all_paths = sorted(paths(manifest), key=str)
    out = []
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(all_paths))
        out.append((path, draw(st.one_of(st.just("delete"), JSON_VALUES))))
    return out


def apply(manifest, mutations):
    m = json.loads(json.dumps(manifest))
    for path, value in mutations:
        node = m
        try:
            for k in path[:-1]:
                node = node[k]
            if value == "delete":
                del node[path[-1]]
            else:
                node[path[-1]] = value
        except (KeyError, IndexError, TypeError):  # an earlier mutation removed or replaced the parent
            pass
    return m


def test_mutated_manifests(work):
    manifest = json.loads((work["orig"] / "edgekv.json").read_text())

    @FUZZ
    @given(mutations=manifest_mutations(manifest))
    def check(mutations):
        count("manifest")
        (work["bundle"] / "edgekv.json").write_text(json.dumps(apply(manifest, mutations)))
        rc, out, err = run(GENERATE(work["bundle"]))
        assert_ok_or_one_line(rc, err)
        if rc == 0 and not any(str(p[0]) in OUTPUT_KEYS for p, _ in mutations):
            assert out == work["answer"]

    try:
        check()
    finally:
        restore(work)


# -- bundle files ----------------------------------------------------------------------------

@st.composite
def file_damage(draw):
    name = draw(st.sampled_from(FILES[1:]))
    kind = draw(st.sampled_from(["flip", "truncate", "append", "zeros"]))
    return name, kind, draw(st.floats(0, 1)), draw(st.integers(1, 4096))


def damage(path, kind, where, n):
    data = bytearray(path.read_bytes())
    at = int(where * (len(data) - 1))
    if kind == "flip":
        for i in range(at, min(at + n, len(data))):
            data[i] ^= 0xA5
    elif kind == "truncate":
        del data[at:]
    elif kind == "append":
        data += os.urandom(n)
    else:
        end = min(at + n, len(data))
        if any(data[at:end]):
            data[at:end] = bytes(end - at)
        else:
            data[at] = 1
    path.write_bytes(bytes(data))


def test_damaged_bundle_files(work):
    @FUZZ
    @given(d=file_damage())
    def check(d):
        count("bundle files")
        name, kind, where, n = d
        restore(work)
        damage(work["bundle"] / name, kind, where, n)
        rc, out, err = run(GENERATE(work["bundle"]))
        assert_ok_or_one_line(rc, err)
        # the oracle for a change load cannot see: verify sees every one
        rc, out, err = run(["verify", work["bundle"], "--full"])
        assert rc == 1, out
        assert_ok_or_one_line(rc, err)

    try:
        check()
    finally:
        restore(work)


# -- saved chats -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat(work):
    from edgekv.chat.session import ChatSession
    from edgekv.format.bundle import load_bundle
    from edgekv.runtime.backends import OrtBackend
    from edgekv.runtime.sampling import SamplingParams
    from edgekv.runtime.text import TextCodec

    b = load_bundle(work["orig"])
    s = ChatSession(b, TextCodec(b), chat_engine(OrtBackend(b, threads=1), b, 128), SamplingParams(),
                    "You are terse.", 8, "drop-turns")
    s.reply("What is the capital of France?")
    good = work["base"] / "good.npz"
    s.save(str(good))
    s.reply("And of Germany?")
    return s, good


def chat_state(s):
    seq = s.seq
    return (seq.cells, seq.ids, seq.sinks), {k: v.tobytes() for k, v in s.cache.read_cells(seq.cells).items()}, \
        json.dumps(s.messages)


META_PATHS = [("edgekv_chat",), ("bundle_sha256",), ("bundle_scheme",), ("system",), ("messages",), ("ids",),
              ("ring",), ("ring", "w"), ("messages", 0), ("messages", 0, "role"), ("ids", 0)]


@st.composite
def saved_chat_damage(draw):
    if draw(st.booleans()):
        return "bytes", draw(file_damage().map(lambda d: d[1:]))
    return "meta", draw(st.lists(st.tuples(st.sampled_from(META_PATHS), st.one_of(st.just("delete"), JSON_VALUES)),
                                 min_size=1, max_size=3))


def test_damaged_saved_chats_load_all_or_nothing(work, chat):
    s, good = chat
    with np.load(good) as z:
        meta = json.loads(bytes(z["__meta__"]).decode())
        arrays = {k: z[k] for k in z.files if k != "__meta__"}

    @FUZZ
    @given(d=saved_chat_damage())
    def check(d):
        count("saved chats")
        path = work["base"] / "fuzzed.npz"
        kind, what = d
        if kind == "bytes":
            shutil.copyfile(good, path)
            damage(path, *what)
        else:
            np.savez(path, __meta__=np.frombuffer(json.dumps(apply(meta, what)).encode(), np.uint8), **arrays)
        before = chat_state(s)
        try:
            s.load(str(path))
        except EdgeKVError as e:
            assert "\n" not in str(e)
            assert chat_state(s) == before
        else:  # loaded: the session is what the file says
            with np.load(path) as z:
                saved = json.loads(bytes(z["__meta__"]).decode())
                assert s.seq.ids == saved["ids"] and s.messages == saved["messages"]
                slots = s.cache.read_cells(s.seq.cells)
                assert all(np.array_equal(slots[k], z[k]) for k in slots)

    check()


# -- chat input ------------------------------------------------------------------------------

LINES = st.one_of(
    st.sampled_from([b"What is the capital of France?", b"/undo", b"/reset", b"/stats", b"/help", b"/frob",
                     b"/save", b"/load", b"/save chat.npz", b"/load chat.npz", b"/load nothing.npz", b"/save .",
                     b"/save missing/x.npz", b"/system", b"/system Be brief.", b"/load edgekv.json"]),
    st.binary(max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b),
    st.text(max_size=300).map(lambda t: t.replace("\n", " ").replace("\r", " ").encode("utf-8", "surrogatepass")))


def test_chat_survives_any_input(work):
    @FUZZ
    @given(lines=st.lists(LINES, max_size=6), context=st.sampled_from(["ring", "drop-turns"]))
    def check(lines, context):
        count("chat input")
        rc, out, err = run(["chat", work["orig"], "--ctx", "64", "--context", context, "--max-new-tokens", "6",
                            "--threads", "1", "--json"], stdin=b"\n".join(lines) + b"\n")
        assert rc == 0 and "Traceback" not in err, err
        for line in out.splitlines():
            json.loads(line)

    check()


# -- command lines ---------------------------------------------------------------------------

# flag -> the values a parse may give it (an oracle written from the issue, not from cli.py)
RANGES = {"ctx": lambda v: v is None or v >= 1, "max_new_tokens": lambda v: v >= 1,
          "temperature": lambda v: v is None or 0 <= v <= 100, "top_k": lambda v: v is None or v >= 0,
          "top_p": lambda v: v is None or 0 < v <= 1, "repeat_penalty": lambda v: v is None or 0 < v <= 100, "seed": lambda v: v is None or v >= 0,
          "threads": lambda v: v is None or v >= 1, "chunks": lambda v: v is None or v >= 1,
          "stride": lambda v: v is None or v >= 1, "repeat": lambda v: v >= 1, "turns": lambda v: v >= 1,
          "decode_tokens": lambda v: v >= 1, "max_prefill": lambda v: v >= 1, "steps": lambda v: v >= 1}
COMMANDS = {"generate": ["B", "hi"], "chat": ["B"], "eval": ["B"], "eval-context": ["B"], "bench": ["B"],
            "build-engine": ["B"], "export": [], "check-trt": ["B"], "verify": ["B"]}
FLAG_VALUES = st.one_of(st.integers(-10**20, 10**20).map(str), st.integers(-3, 5).map(str),
                        st.floats(allow_nan=True, allow_infinity=True).map(repr),
                        st.sampled_from(["nan", "inf", "-0", "0x10", "1e3", "", "abc", "1,2", "1,,2", "3,-1"]))
FLAGS = ["--ctx", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--repeat-penalty", "--seed",
         "--threads", "--chunks", "--stride", "--repeat", "--turns", "--decode-tokens", "--max-prefill", "--steps",
         "--capacities", "--fill", "--prompt-lengths", "--sinks", "--calib-tokens", "--workspace-mib"]


def test_command_lines(work):
    parser = build_parser()

    @FUZZ
    @given(cmd=st.sampled_from(sorted(COMMANDS)), flags=st.lists(st.tuples(st.sampled_from(FLAGS), FLAG_VALUES),
                                                                  max_size=3))
    def check(cmd, flags):
        count("command lines")
        argv = [cmd, *COMMANDS[cmd]] + [x for f, v in flags for x in (f, v)]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                args = parser.parse_args(argv)
            except SystemExit as e:
                assert e.code == 2
                assert_ok_or_one_line(2, err.getvalue())
                return
        for name, ok in RANGES.items():
            if hasattr(args, name):
                assert ok(getattr(args, name)), (name, getattr(args, name))
        if cmd == "generate":  # and it runs: a correct answer or one line
            rc, out, e = run([cmd, work["orig"], "What is the capital of France?"] + argv[3:]
                             + ["--max-new-tokens", "4", "--threads", "1"])
            assert_ok_or_one_line(rc, e)

    check()


@FUZZ
@given(st.integers(1, 48).flatmap(lambda cap: st.tuples(
    st.just(cap),
    st.lists(st.lists(st.integers(0, cap - 1), max_size=8), max_size=4),  # sequences' cells
    st.lists(st.lists(st.integers(0, cap - 1), min_size=1, max_size=8), max_size=4))))  # cached entries
def test_pool_compaction_puts_sequences_first_cache_last_moving_only_what_must_move(case):
    """Any pool: after compaction the sequences' cells are [0, n_live), the cells only the cache
    holds are the top of the pool, the free ones one run between; every owner keeps the contents
    it had (followed through the permutation), and no cell moves that did not have to."""
    from edgekv.runtime.pool import CellPool
    cap, seqs, entries = case
    pool = CellPool(cap)
    seqs = [np.unique(np.asarray(c, np.int64)) for c in seqs]
    for cells in seqs:
        pool.take(cells)
    for i, cells in enumerate(entries):
        pool.remember([1000 + i], np.unique(cells))
    before = {k: v.copy() for k, v in pool.prefixes.items()}
    live, used = pool.live(), pool.refs > 0
    n_live, top = int(live.sum()), cap - int((used & ~live).sum())
    must = int(live[n_live:].sum()) + int((used & ~live)[:top].sum())
    perm, moved = pool.compaction()
    assert sorted(perm.tolist()) == list(range(cap))
    assert sorted(moved.tolist()) == np.flatnonzero((perm != np.arange(cap)) & used).tolist() and moved.size == must
    pool.relabel(perm)
    assert pool.live().tolist() == [True] * n_live + [False] * (cap - n_live)
    cached = (pool.refs > 0) & ~pool.live()
    assert cached.tolist() == [False] * top + [True] * (cap - top)
    # every owner's cells followed through the permutation: the counts are the owners' again
    for key, cells in pool.prefixes.items():
        assert (cells == perm[before[key]]).all()
    owners, cache_owners = np.zeros(cap, np.int64), np.zeros(cap, np.int64)
    for cells in seqs:
        np.add.at(owners, perm[cells], 1)
    for cells in pool.prefixes.values():
        np.add.at(owners, cells, 1)
        np.add.at(cache_owners, cells, 1)
    assert (pool.refs == owners).all() and (pool.cache_refs == cache_owners).all()
