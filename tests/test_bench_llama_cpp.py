"""`edgekv bench --llama-cpp`: llama.cpp gets the same prompts, fills and threads as the bundle
(a fake llama_cpp module records what it was fed), the ratios are edgekv / llama.cpp, and a
missing llama-cpp-python is one line that says how to install it."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from edgekv.errors import EdgeKVError
from edgekv.tools import bench
from edgekv.tools.bench import llama_cpp_ratios, sample_tokens
from tests.conftest import ROOT

FAKE = '''
import ctypes, json, os
__version__ = "fake"
LOG = os.environ["FAKE_LLAMA_LOG"]
VOCAB = 384

class Llama:
    def __init__(self, model_path, n_ctx, n_batch, n_threads, n_threads_batch, verbose):
        self.n_tokens = 0
        self.ctx = object()
        self.logits = (ctypes.c_float * VOCAB)()
        self._log({"init": [model_path, n_ctx, n_threads, n_threads_batch]})

    def _log(self, rec):
        with open(LOG, "a") as f:
            f.write(json.dumps(rec) + "\\n")

    def n_vocab(self):
        return VOCAB

    def reset(self):
        self.n_tokens = 0

    def eval(self, tokens):
        self._log({"eval": [self.n_tokens, [int(t) for t in tokens]]})
        self.n_tokens += len(tokens)
        self.logits[(self.n_tokens * 7) % VOCAB] = float(self.n_tokens)

def llama_get_logits_ith(ctx, i):
    return ctypes.cast(_current.logits, ctypes.POINTER(ctypes.c_float))
'''


@pytest.fixture()
def fake_llama(tmp_path):
    pkg = tmp_path / "fake" / "llama_cpp"
    pkg.mkdir(parents=True)
    # the logits pointer is the last Llama made (one per process here)
    (pkg / "__init__.py").write_text(FAKE.replace("        self._log({\"init\"", "        global _current\n        _current = self\n        self._log({\"init\""))
    (pkg / "llama_cpp.py").write_text("def llama_model_default_params():\n    return None\n")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return tmp_path / "fake", gguf, tmp_path / "llama.log"


def test_llama_cpp_gets_the_same_prompts_fills_and_threads(tiny_bundle_int8, fake_llama, tmp_path):
    fake, gguf, log = fake_llama
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=f"{fake}{os.pathsep}{ROOT}", FAKE_LLAMA_LOG=str(log))
    r = subprocess.run([sys.executable, "-m", "edgekv", "bench", str(tiny_bundle_int8), "--prompt-lengths", "8,12",
                        "--capacities", "32,64", "--fill", "8,20", "--decode-tokens", "4", "--rss-tokens", "20",
                        "--repeat", "1", "--threads", "1", "--json", str(out), "--llama-cpp", str(gguf)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert recs[0]["init"] == [str(gguf), 64, 1, 1]  # the bundle's largest capacity, the same threads
    prompts = [e["eval"][1] for e in (x for x in recs if "eval" in x) if e["eval"][0] == 0]
    steps = [e["eval"] for e in (x for x in recs if "eval" in x) if e["eval"][0] > 0]
    vocab = 384
    # each prompt length (8, 12) and fill (8, 20): the bench's own token ids, warm-up round + 1
    want = {L: sample_tokens(L, vocab) for L in (8, 12, 20)}
    assert sorted(map(len, prompts)) == [8, 8, 12, 12, 20, 20]
    assert all(p == want[len(p)] for p in prompts)
    assert all(len(toks) == 1 for _, toks in steps) and len(steps) == 6 * 4  # 4 decode tokens per run
    d = json.loads(out.read_text())
    rows = {x["prompt_tokens"]: x for x in d["vs_llama_cpp"]["by_prompt"]}
    assert set(rows) == {8, 12, 20}
    for L, row in rows.items():
        mine = max((x for x in d["runs"] if x["prompt_tokens"] == L), key=lambda x: x["capacity"])
        theirs = next(x for x in d["llama_cpp"]["runs"] if x["prompt_tokens"] == L)
        assert row["decode_ratio"] == pytest.approx(mine["decode_tps"] / theirs["decode_tps"])
    assert "ratio = edgekv / llama.cpp" in r.stdout


def test_ratios_are_edgekv_over_llama_cpp_at_the_largest_capacity():
    ours = [{"capacity": 256, "prompt_tokens": 64, "decode_tps": 50.0, "ttft_ms": 10.0},
            {"capacity": 4096, "prompt_tokens": 64, "decode_tps": 30.0, "ttft_ms": 20.0},
            {"capacity": 4096, "prompt_tokens": 1800, "decode_tps": 15.0, "ttft_ms": 900.0}]
    theirs = [{"prompt_tokens": 1800, "decode_tps": 60.0, "ttft_ms": 1800.0},
              {"prompt_tokens": 64, "decode_tps": 120.0, "ttft_ms": 40.0},
              {"prompt_tokens": 999, "decode_tps": 1.0, "ttft_ms": 1.0}]  # no edgekv row: left out
    r = llama_cpp_ratios(ours, theirs, 450.0, 300.0)
    assert [(x["prompt_tokens"], x["decode_ratio"], x["ttft_ratio"]) for x in r["by_prompt"]] == \
        [(64, 0.25, 0.5), (1800, 0.25, 0.5)]
    assert r["peak_rss_ratio"] == 1.5


def test_missing_llama_cpp_python_is_one_line_with_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(EdgeKVError, match=r'CMAKE_ARGS="-DGGML_NATIVE=OFF[^"]*" pip install "edgekv\[bench\]"') as e:
        bench.llama_cpp_gguf("")
    assert "\n" not in str(e.value) and f'CMAKE_ARGS="{bench.LLAMA_CPP_FLAGS}"' in str(e.value)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_default_gguf_is_the_default_models():
    try:
        path = bench.llama_cpp_gguf("")
    except EdgeKVError as e:
        pytest.skip(str(e))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_several_bundles_one_table_and_llama_cpp_timed_once(tiny_bundle_int8, tiny_bundle_float, fake_llama, tmp_path):
    fake, gguf, log = fake_llama
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=f"{fake}{os.pathsep}{ROOT}", FAKE_LLAMA_LOG=str(log))
    r = subprocess.run([sys.executable, "-m", "edgekv", "bench", str(tiny_bundle_float), str(tiny_bundle_int8),
                        "--prompt-lengths", "8", "--capacities", "32", "--fill", "8,12", "--decode-tokens", "4",
                        "--rss-tokens", "20", "--repeat", "1", "--threads", "1", "--json", str(out),
                        "--llama-cpp", str(gguf)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum("init" in x for x in recs) == 1  # llama.cpp once for all bundles
    d = json.loads(out.read_text())
    assert [b["bundle"] for b in d["bundles"]] == [str(tiny_bundle_float), str(tiny_bundle_int8)]
    for b in d["bundles"]:
        assert b["kv_scheme"] == ("float" if b["bundle"] == str(tiny_bundle_float) else "int8")
        by = {x["prompt_tokens"]: x for x in b["vs_llama_cpp"]["by_prompt"]}
        assert set(by) == {8, 12}
        theirs = {x["prompt_tokens"]: x for x in d["llama_cpp"]["runs"]}
        assert by[12]["decode_ratio"] == pytest.approx(by[12]["decode_tps"] / theirs[12]["decode_tps"])
        own = max((x for x in b["runs"] if x["prompt_tokens"] == 12), key=lambda x: x["capacity"])
        assert by[12]["decode_tps"] == own["decode_tps"]  # this bundle's own run, not another's
        assert b["vs_llama_cpp"]["peak_rss_ratio"] == pytest.approx(b["peak_rss_mib"] / d["llama_cpp"]["peak_rss_mib"])
    table = r.stdout[r.stdout.index("tok/s@8"):]
    rows = [line for line in table.splitlines() if line.startswith((tiny_bundle_float.name, tiny_bundle_int8.name,
                                                                    "llama.cpp", "  / llama.cpp"))]
    assert len(rows) == 5, table  # two bundles, each with its ratio row, and llama.cpp
    for b in d["bundles"]:  # the printed ratio is the JSON's
        i = next(k for k, line in enumerate(rows) if line.startswith(Path(b["bundle"]).name))
        ratio = float(rows[i + 1].split()[3].rstrip("x"))  # '/', 'llama.cpp', tok/s@8, tok/s@12
        assert ratio == pytest.approx(b["vs_llama_cpp"]["by_prompt"][1]["decode_ratio"], abs=0.006)


def test_a_bad_second_bundle_is_refused_before_any_timing(tiny_bundle_int8, tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgekv", "bench", str(tiny_bundle_int8), str(tmp_path / "nope")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "nope" in r.stderr
    assert "configurations" not in r.stderr


def test_transformers_with_several_bundles_is_one_line(tiny_bundle_int8, tiny_bundle_float):
    r = subprocess.run([sys.executable, "-m", "edgekv", "bench", str(tiny_bundle_int8), str(tiny_bundle_float),
                        "--transformers", "smollm2-135m-instruct"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "give it one bundle" in r.stderr
    assert "configurations" not in r.stderr and not r.stdout


# a llama-cpp-python built for instructions this CPU does not run (GGML_NATIVE=ON where the VM does
# not enable the AMX the CPU reports): its process dies of SIGILL as soon as llama.cpp runs
SIGILL_FAKE = '''
import os, resource, signal
from . import llama_cpp  # the ctypes module, as in the real package
__version__ = "fake-sigill"

class Llama:
    def __init__(self, *args, **kwargs):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the test's folder
        os.kill(os.getpid(), signal.SIGILL)
'''


def fake_llama_package(tmp_path, name: str, source: str):
    """(folder to put on PYTHONPATH, a stand-in .gguf): a llama_cpp package whose module is `source`."""
    pkg = tmp_path / name / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(source)
    (pkg / "llama_cpp.py").write_text("def llama_model_default_params():\n    return None\n")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return tmp_path / name, gguf


@pytest.fixture()
def sigill_llama(tmp_path):
    return fake_llama_package(tmp_path, "sigill", SIGILL_FAKE)


def test_llama_cpp_dying_of_sigill_is_one_line_with_the_rebuild_flags(tiny_bundle_int8, sigill_llama, tmp_path):
    """The peer's crash ends its own process only: edgekv prints its table and JSON, then one
    error line naming the build flags that work, and exits 1 (no traceback, no signal of its own)."""
    from tests.test_cli_errors import assert_clean_error

    fake, gguf = sigill_llama
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=f"{fake}{os.pathsep}{ROOT}")
    r = subprocess.run([sys.executable, "-m", "edgekv", "bench", str(tiny_bundle_int8), "--prompt-lengths", "8",
                        "--capacities", "32", "--fill", "8", "--decode-tokens", "2", "--rss-tokens", "20",
                        "--repeat", "1", "--threads", "1", "--json", str(out), "--llama-cpp", str(gguf)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert_clean_error(r, "llama.cpp died of an illegal instruction (SIGILL)")
    assert f'CMAKE_ARGS="{bench.LLAMA_CPP_FLAGS}"' in r.stderr.strip().splitlines()[-1]
    assert "decode tok/s" in r.stdout and "of the bound" in r.stdout  # edgekv's own results, printed
    assert "llama_cpp" not in json.loads(out.read_text())


@pytest.mark.parametrize("cmd", ["bench", "eval"])
def test_llama_cpp_help_names_the_build_flags(cmd):
    r = subprocess.run([sys.executable, "-m", "edgekv", cmd, "--help"], capture_output=True, text=True, cwd=ROOT)
    text = " ".join(r.stdout.split())  # argparse wraps lines
    assert f'CMAKE_ARGS="{bench.LLAMA_CPP_FLAGS}"' in text and "GGML_NATIVE=ON" not in text


def test_attentions_take_turns_with_llama_cpp(tiny_bundle_float, fake_llama, tmp_path):
    """--attention plain,fused: each attention in its own process, llama.cpp once per round
    (--repeat rounds), the bundle's rows say which graph ran, and each ratio is the median of
    the per-round ratios (median_ratios, checked on its own below)."""
    fake, gguf, log = fake_llama
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=f"{fake}{os.pathsep}{ROOT}", FAKE_LLAMA_LOG=str(log))
    r = subprocess.run([sys.executable, "-m", "edgekv", "bench", str(tiny_bundle_float), "--attention", "plain,fused",
                        "--prompt-lengths", "8", "--capacities", "32", "--fill", "8", "--decode-tokens", "2",
                        "--rss-tokens", "10", "--repeat", "2", "--threads", "1", "--json", str(out),
                        "--llama-cpp", str(gguf)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert sum("init" in x for x in recs) == 2  # llama.cpp once per round
    d = json.loads(out.read_text())
    assert d["rounds"] == 2 and [b["fused"] for b in d["bundles"]] == [False, True]
    assert d["bundles"][1]["attention"].startswith("attention: fused")
    assert all(b["vs_llama_cpp"]["rounds"] == 2 for b in d["bundles"])
    assert r.stderr.count("round 2/2, 2/2") == 1 and "[fused]" in r.stdout and "load average" in r.stdout


def test_median_ratios_are_medians_of_the_rounds():
    rounds = [{"by_prompt": [{"prompt_tokens": 64, "decode_ratio": x, "ttft_ratio": 1 / x}], "peak_rss_ratio": x / 2}
              for x in (1.0, 3.0, 1.6)]
    m = bench.median_ratios(rounds)
    assert m["by_prompt"] == [{"prompt_tokens": 64, "decode_ratio": 1.6, "ttft_ratio": 1 / 1.6}]
    assert m["peak_rss_ratio"] == 0.8 and m["rounds"] == 3


def test_an_unknown_attention_is_one_line(tiny_bundle_float):
    r = subprocess.run([sys.executable, "-m", "edgekv", "bench", str(tiny_bundle_float), "--attention", "plain,fast"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0 and r.stderr.count("\n") == 1 and "fast" in r.stderr and "fused" in r.stderr
