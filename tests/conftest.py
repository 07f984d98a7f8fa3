"""Fixtures: tiny random models (HF folders built from a config here), their bundles, and the
real default model's bundle (exported once per test session)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:  # first, before transformers or torch import sympy: the export package sets sympy's cache (export/__init__.py)
    import export  # noqa: F401
except ImportError:  # the runtime-only install: no exporter
    pass

ROOT = Path(__file__).resolve().parent.parent
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TINY_VOCAB = 384


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): a run of one file stays in this process, where starting
    workers that each import and collect everything again costs more than it could save
    (`pytest tests/test_x.py`, tests/mutation_check.py's runs); otherwise xdist's default, one
    worker per core (PYTEST_XDIST_AUTO_NUM_WORKERS overrides it)."""
    named = {arg.split("::")[0] for arg in config.args}
    if len(named) == 1 and Path(next(iter(named))).is_file():
        return 0
    return None


def pytest_configure(config):
    """A run on several workers (-n auto: one per core) gives each worker's torch and onnxruntime
    its share of the cores (OMP_NUM_THREADS, which edgekv's default thread count follows too),
    set here before xdist starts the workers (they and their subprocesses inherit it): two
    workers each spinning two compute threads on two cores cost ~40 % more CPU (measured on the
    whole run). glibc keeps large freed blocks for reuse instead of unmapping them (torch's
    attention temporaries were zeroed page by page on every forward). A run in one process, or
    the caller's own settings, are left as they are."""
    use_trace_cache()
    workers = config.getoption("numprocesses", None) or 0
    if os.environ.get("PYTEST_XDIST_WORKER") or workers < 2:
        return
    from edgekv.runtime.backends.base import default_threads  # the caller's OMP_NUM_THREADS, else the CPUs

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, default_threads() // workers)))
    for knob in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        os.environ.setdefault(knob, str(16 << 30))


def use_trace_cache() -> None:
    """Outside CI, torch.onnx traces are reused across runs while no exporter source changes
    (tests/trace_cache.py); EDGEKV_TRACE_CACHE=off traces every time, =verify checks every reuse
    against a fresh trace. To empty it: rm -r models/bundles/.test-cache/*/traces"""
    mode = os.environ.get("EDGEKV_TRACE_CACHE", "on").lower()
    if os.environ.get("CI") or mode in ("off", "0", "false", "no"):
        return
    try:
        import export.onnx_export as oe
        from export.manifest import exporter_source_key
    except ImportError:  # the runtime-only install
        return
    from tests.trace_cache import cached

    oe._trace = cached(oe._trace, TEST_CACHE / exporter_source_key() / "traces", verify=mode == "verify")


# Files xdist hands out test by test instead of whole (pyproject: --dist loadfile): each alone
# ran long enough to decide the wall time of a run on two workers (minutes: an export per
# architecture; Ctrl-C at every line of a turn, twice), and what their tests share is cheap to
# make in both workers or made per test (each architecture's bundle is exported by its own test).
SPLIT_FILES = frozenset({"test_architectures.py", "test_chat_engine.py"})


def work_unit(nodeid: str) -> str:
    """The unit xdist gives one worker: the test's file, or the test itself in SPLIT_FILES."""
    file = nodeid.split("::", 1)[0]
    return nodeid if Path(file).name in SPLIT_FILES else file


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with SPLIT_FILES split (work_unit); other modes as xdist has them."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SplitLongFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return SplitLongFiles(config, log)


# Files that export several tiny models of their own (20-80 s of CPU each, measured): handed out
# right after the slow files, so that no worker ends the run alone on one of them (test_stamp,
# last in line by its test count, left one worker running ~45 s after the other had finished).
HEAVY_FILES = frozenset({"test_fused_archs.py", "test_stamp.py", "test_gemma3.py", "test_trt_check.py",
                         "test_fused_gemma3.py"})

# files handed out after this many others: by then the run's one real export (~170 s on a quiet
# 2-core machine) is done, so a second worker does not sit on its lock (measured: 141 s did)
REAL_AFTER = 12


def pytest_collection_modifyitems(config, items):
    """The order whole files go to xdist's workers (pyproject: --no-loadscope-reorder): first one
    file that needs the real bundle (it starts the run's one real export), then the other slow
    files (their real-model work overlaps the export), then HEAVY_FILES, then files with more tests
    first, as xdist orders them, with the other files needing the real bundle placed REAL_AFTER
    files in, when the export is done. Within a file, the file's own order."""
    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(item)
    slow = {f for f, its in files.items() if any(i.get_closest_marker("slow") for i in its)}
    real = [f for f in files if any("real_bundle_int4" in i.fixturenames for i in files[f])]
    order = sorted(files, key=lambda f: (f not in slow, Path(f).name not in HEAVY_FILES, -len(files[f])))
    rest = [f for f in order if f not in real]  # (sorted: the slow files are already first)
    order = real[:1] + rest[:REAL_AFTER] + real[1:] + rest[REAL_AFTER:]
    items[:] = [i for f in order for i in files[f]]


def tiny_tokenizer_json() -> str:
    """A small byte-level BPE trained here on a few sentences, with chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 8, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["The capital of France is Paris. The capital of Germany is Berlin.",
            "What is the capital of France? Tell me about robots, trains and tea.",
            "Der schnelle braune Fuchs. Café, naïve, 東京, 🙂 emoji and ünïcödé text."] * 20
    tok.train_from_iterator(text, trainer)
    return tok.to_str()


def make_hf_folder(path: Path, arch: str = "llama", **overrides) -> Path:
    """A random tiny checkpoint written by transformers itself (config.json + safetensors)."""
    import torch
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random init is small; widen it so attention is not ~uniform
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "bias" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(tiny_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}))
    return path


def run_constrained(rt, c, prompt_ids, max_new, params, stop_ids):
    """(token ids, stats, the constraint): one request under constraint `c` through a batcher of
    its own, as `edgekv generate` decodes it."""
    from edgekv.runtime.batching import Request
    from edgekv.runtime.batching.request import now
    from edgekv.runtime.stats import stats_of

    batcher = rt.batcher(parallel=1, max_queue=1, max_prefixes=0)
    req = Request(prompt_ids, max_new, params, stop_ids, constraint=c)
    t0 = now()
    batcher.run(req)
    return list(req.out), stats_of(req, t0), c


def chat_engine(backend, bundle, ctx: int, chunk: int | None = None, windowed: bool = True, margin: int | None = None):
    """The batcher `edgekv chat` runs a conversation on: a pool of ctx cells, no prefix cache,
    windowed where the bundle and the backend allow it (Gemma 3 on ort-cpu's graph as written;
    `margin`: its ring's slots beyond the window's, default chat's)."""
    from edgekv.runtime.assemble import RING_MARGIN, pool_cache
    from edgekv.runtime.backends.base import PREFILL_CHUNK
    from edgekv.runtime.batching import Batcher

    cache = pool_cache(bundle, backend, ctx, windowed, 1, RING_MARGIN if margin is None else margin)
    return Batcher(backend, cache, parallel=1, max_queue=1,
                   prefill_chunk=chunk or PREFILL_CHUNK, max_prefixes=0)


# Ctrl-C tests (test_chat_engine, test_chat_hardening) interrupt at the first run of every distinct
# line of the traced files (each code path where it is first met: the first prefill chunk, the
# first decode step, the stop, the commit; the first array a save writes) and at every STRIDE-th
# line run besides (the same lines in later chunks, steps and arrays): ~1/6 of the runs and of
# the time of one run per line run, every line met.
STRIDE = 16


def interrupt_points(lines: list) -> list:
    """The k (1-based, in run order) of the lines to interrupt at, given the lines one run ran:
    each distinct line's first run, and every STRIDE-th."""
    firsts = {}
    for k, line in enumerate(lines, 1):
        firsts.setdefault(line, k)
    return sorted(set(firsts.values()) | set(range(STRIDE, len(lines) + 1, STRIDE)))


def lines_run(files: tuple, run):
    """run() uninterrupted: (what it returned, the (file, line) of each line it ran in files, a
    tuple of path endings as str.endswith takes)."""
    seen = []

    def trace(frame, event, arg):
        return local if frame.f_code.co_filename.endswith(files) else None

    def local(frame, event, arg):
        if event == "line":
            seen.append((frame.f_code.co_filename, frame.f_lineno))
        return local
    sys.settrace(trace)
    try:
        out = run()
    finally:
        sys.settrace(None)
    return out, seen


def run_edgekv(*args, timeout=900, input=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "edgekv", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, input=input, env=env, cwd=ROOT)


def cli(*args, input: str | bytes | None = None) -> subprocess.CompletedProcess:
    """`edgekv ARGS` run in this process (cli.main, argparse's exits included), returned as
    run_edgekv returns it: for tests of what a command prints and returns, where a new Python
    and its imports per call buy nothing (the entry point itself keeps its subprocess tests)."""
    import contextlib
    import io

    from edgekv.cli import main

    out, err = io.StringIO(), io.StringIO()
    stdin = sys.stdin
    if input is not None:
        data = input.encode() if isinstance(input, str) else input
        sys.stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in args])
            except SystemExit as e:  # argparse: --help, --version, bad flags
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdin = stdin
    return subprocess.CompletedProcess(["edgekv", *map(str, args)], rc, out.getvalue(), err.getvalue())


def run_dir(tmp_path_factory) -> Path:
    """One folder for this whole test run: with pytest-xdist each worker's basetemp is a folder
    of the run's (popen-gwN), so the parent is what every worker shares."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    shared.mkdir(exist_ok=True)
    return shared


def made_once(path: Path, make) -> Path:
    """`make(path)` by the first worker to get here; the others wait on the lock and take what it
    made (a marker file says it finished: a worker that died half-way leaves none)."""
    from filelock import FileLock

    done = path.with_name(path.name + ".done")
    with FileLock(str(path) + ".lock"):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            make(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return made_once(run_dir(tmp_path_factory) / "tiny-llama", lambda p: make_hf_folder(p, "llama"))


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    return made_once(run_dir(tmp_path_factory) / "tiny-qwen",
                     lambda p: make_hf_folder(p, "qwen2", tie_word_embeddings=True))


def _export(src: Path, out: Path, kv: str, max_context: int = 256) -> Path:
    from export.pipeline import export_bundle

    return export_bundle(str(src), kv=kv, out=str(out), max_context=max_context, steps=8)


def tiny_export(tmp_path_factory, src: Path, name: str, kv: str) -> Path:
    """The tiny model `src` exported with `kv` once per run (every worker gets the same bundle)."""
    return made_once(run_dir(tmp_path_factory) / name, lambda p: _export(src, p, kv))


@pytest.fixture(scope="session")
def tiny_bundles(tiny_llama, tmp_path_factory):
    """kv -> the tiny Llama exported with that KV scheme (named tiny-KV), once per run."""
    return lambda kv: tiny_export(tmp_path_factory, tiny_llama, f"tiny-{kv}", kv)


@pytest.fixture(scope="session")
def tiny_bundle_int8(tiny_bundles) -> Path:
    return tiny_bundles("int8")


@pytest.fixture(scope="session")
def tiny_bundle_float(tiny_bundles) -> Path:
    return tiny_bundles("float")


@pytest.fixture(scope="session")
def tiny_qwen_bundle_float(tiny_qwen, tmp_path_factory) -> Path:
    """The tiny Qwen2 (biases, tied embeddings) with a float cache: another model than tiny-*."""
    return tiny_export(tmp_path_factory, tiny_qwen, "tiny-qwen-float", "float")


@pytest.fixture(scope="session")
def tiny_bundle_int8_static(tiny_bundles) -> Path:
    """The tiny Llama with the calibrated static int8 cache (what onnxruntime's fused attention
    takes), once per run."""
    return tiny_bundles("int8-static")


def optimized_graph(bundle, monkeypatch, tmp_path, attention: str | None = None):
    """The graph onnxruntime really runs (an onnx GraphProto), as the runtime's own backend builds it."""
    import onnx
    import onnxruntime as ort

    from edgekv.runtime.assemble import open_runtime

    real = ort.SessionOptions
    path = tmp_path / "optimized.onnx"

    def options():
        o = real()
        o.optimized_model_filepath = str(path)
        return o

    monkeypatch.setattr(ort, "SessionOptions", options)
    open_runtime(bundle, None, "ort-cpu", threads=1, log=None, attention=attention).close()
    monkeypatch.setattr(ort, "SessionOptions", real)
    return onnx.load(str(path), load_external_data=False).graph


def _gguf_quickstart_types(name: str):
    """The quickstart file's kinds of blocks: Q8_0 embedding and head, Q4_1 matrices."""
    import gguf

    T = gguf.GGMLQuantizationType
    return T.Q8_0 if name.startswith(("token_embd", "output.")) else T.Q4_1


@pytest.fixture(scope="session")
def tiny_gguf_bundles(tiny_llama, tmp_path_factory):
    """kv -> the tiny Llama as the quickstart's bundle is made: a GGUF of Q4_1 matrices and a Q8_0
    head, its blocks kept (onnxruntime's 4- and 8-bit MatMulNBits), that KV scheme; once per run."""
    from export.pipeline import export_bundle
    from tests.test_gguf import write_gguf

    def make(kv: str, path: Path) -> None:
        path.mkdir(parents=True)
        write_gguf(tiny_llama, path / "tiny-q41.gguf", quant=_gguf_quickstart_types)
        export_bundle(str(path / "tiny-q41.gguf"), kv=kv, out=str(path / "bundle"), max_context=256, steps=4,
                      weights="int4")
    return lambda kv: made_once(run_dir(tmp_path_factory) / f"tiny-{kv}-wint4", lambda p: make(kv, p)) / "bundle"


@pytest.fixture(scope="session")
def tiny_bundle_int8_wint4(tiny_gguf_bundles) -> Path:
    return tiny_gguf_bundles("int8")


@pytest.fixture(scope="session")
def tiny_qwen_bundle_int8_static(tiny_qwen, tmp_path_factory) -> Path:
    """The tiny Qwen2 with the calibrated static int8 cache, once per run."""
    return tiny_export(tmp_path_factory, tiny_qwen, "tiny-qwen-int8-static", "int8-static")


@pytest.fixture(scope="session")
def arch_folders(tmp_path_factory):
    """name -> tests/archs.py's tiny checkpoint of that architecture (ARCHS or VARIANTS), made
    once per run (test_architectures, test_gemma3 and the fused tests share them)."""
    from tests.archs import make_arch_folder

    return lambda name: made_once(run_dir(tmp_path_factory) / f"arch-{name}", lambda p: make_arch_folder(p, name))


@pytest.fixture(scope="session")
def arch_bundles(arch_folders, tmp_path_factory):
    """(name, kv, context, steps=8, dtype) -> arch_folders(name) exported so, once per run, keyed
    by all of them (export_bundle raises unless its parity check over `steps` decode steps and
    check-trt pass)."""
    from export.pipeline import export_bundle

    def get(name: str, kv: str, context: int, steps: int = 8, dtype: str = "float32") -> Path:
        def make(path: Path) -> None:
            export_bundle(str(arch_folders(name)), kv=kv, out=str(path), max_context=context, steps=steps, dtype=dtype)
        return made_once(run_dir(tmp_path_factory) / f"arch-{name}-{kv}-{dtype}-ctx{context}-steps{steps}", make)
    return get


REAL_NAME = "smollm2-135m-instruct-int8"
TEST_CACHE = ROOT / "models" / "bundles" / ".test-cache"


def made_by_this_exporter(path: Path, key: str, kv: str) -> bool:
    """`path` is a loadable bundle whose manifest records the exporter source key `key` and a KV
    scheme that `--kv kv` exports (auto: either of its choices)."""
    from edgekv.errors import BundleError
    from edgekv.format.bundle import load_bundle

    try:
        from export.kv_gate import AUTO, AUTO_CHOICES

        m = load_bundle(path).manifest
        return m["exporter"].get("source_key") == key and m["kv"]["scheme"] in (AUTO_CHOICES if kv == AUTO else (kv,))
    except (BundleError, KeyError, AttributeError):
        return False


INT4_NAME = "smollm2-135m-instruct-int8-wint4"  # what models/quickstart.sh exports
# decode steps of the exporter's parity check in the real exports here (the command's default is
# 32): the export still refuses a graph that is not torch's, and the real-model tests check the
# bundle's own decode at length (32 greedy steps cached = uncached, batched = alone over 16)
REAL_PARITY_STEPS = 8


def real_export(tmp_path_factory, name: str, weights: str, kv: str) -> Path:
    """The default recipe with KV scheme `kv` and `weights`, by the exporter under test, once
    per run: in CI always exported afresh (into the run's folder); elsewhere reused only if the
    exporter's sources are the ones that made it (export/manifest.py's exporter_source_key):
    models/bundles/NAME, or one kept under models/bundles/.test-cache/<key>/. A file lock makes
    the workers of a run (and concurrent runs) export it once and wait for it."""
    from export.manifest import exporter_source_key
    from export.pipeline import export_bundle

    def export(path: Path) -> None:
        export_bundle(None, kv=kv, weights=weights, out=str(path), steps=REAL_PARITY_STEPS)

    if os.environ.get("CI"):  # a clean run: always export
        return made_once(run_dir(tmp_path_factory) / name, export)
    from filelock import FileLock

    key = exporter_source_key()
    kept = TEST_CACHE / key / name
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    with FileLock(str(TEST_CACHE / f"{key}-{name}.lock")):
        for candidate in (ROOT / "models" / "bundles" / name, kept):
            if made_by_this_exporter(candidate, key, kv):
                return candidate
        for old in TEST_CACHE.iterdir():  # bundles of other exporter sources are stale: make room
            if old.is_dir() and old.name != key:  # (their lock files are left: a few bytes each)
                shutil.rmtree(old, ignore_errors=True)
        export(kept)
    return kept


@pytest.fixture(scope="session")
def real_bundle(tmp_path_factory) -> Path:
    """The default model, float weights, int8 KV (`edgekv export --kv int8 --weights float`)."""
    return real_export(tmp_path_factory, REAL_NAME, "float", "int8")


@pytest.fixture(scope="session")
def real_bundle_int4(tmp_path_factory) -> Path:
    """The quickstart's bundle as it makes it: the default model with its GGUF's own 4-bit blocks
    and export's default KV scheme (--kv auto: int8-static where its held-out check holds)."""
    return real_export(tmp_path_factory, INT4_NAME, "int4", "auto")


@pytest.fixture(scope="module")
def rt_float(tiny_bundle_float):
    """The tiny float-KV bundle on ort-cpu, for the serving engine's tests (closed after the module)."""
    from edgekv.runtime.assemble import open_runtime
    with open_runtime(tiny_bundle_float, ctx=256, backend="ort-cpu", threads=1) as r:
        yield r


@pytest.fixture(scope="module")
def rt_int8(tiny_bundle_int8):
    """The tiny int8-KV bundle on ort-cpu, 256 cells (closed after the module)."""
    from edgekv.runtime.assemble import open_runtime
    with open_runtime(tiny_bundle_int8, ctx=256, backend="ort-cpu", threads=1) as r:
        yield r


@pytest.fixture
def bundle_copy(tiny_bundle_int8, tmp_path) -> Path:
    """A copy of the tiny int8 bundle a test may damage."""
    dst = tmp_path / "b"
    shutil.copytree(tiny_bundle_int8, dst)
    return dst
