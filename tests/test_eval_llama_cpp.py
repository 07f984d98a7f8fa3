"""`edgekv eval --llama-cpp`: llama.cpp is scored on the same windows and token ids as the
bundles, against the same reference. A fake llama_cpp module records what it was fed, and its
row j puts logit 5 on the token it was fed at j + 1 (the last row of a call, which has no next
token, is uniform): scored on the right rows, its perplexity follows in closed form."""
import json
import math
import os
import subprocess
import sys

import pytest

from edgekv.format.bundle import load_bundle
from edgekv.runtime.text import TextCodec
from tests.conftest import ROOT

FAKE = '''
import json, os
from . import llama_cpp  # the ctypes module, as in the real package
import numpy as np
LOG = os.environ["FAKE_LLAMA_LOG"]
VOCAB = int(os.environ["FAKE_LLAMA_VOCAB"])
PEAK = 5.0

class Llama:
    def __init__(self, model_path, n_ctx, n_batch, n_threads, logits_all, verbose):
        assert logits_all
        with open(model_path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"Failed to load model from file: {model_path}")
        self.scores = np.zeros((n_ctx, VOCAB), np.float32)
        self.n_ctx = n_ctx

    def n_vocab(self):
        return VOCAB

    def reset(self):
        self.n = 0
        self.scores[:] = 0.0

    def eval(self, tokens):
        assert self.n + len(tokens) <= self.n_ctx
        with open(LOG, "a") as f:
            f.write(json.dumps([self.n, [int(t) for t in tokens]]) + "\\n")
        for j in range(len(tokens) - 1):
            self.scores[self.n + j, tokens[j + 1]] = PEAK
        self.n += len(tokens)
'''


@pytest.fixture()
def fake_llama(tmp_path):
    from tests.test_bench_llama_cpp import fake_llama_package

    return (*fake_llama_package(tmp_path, "fake", FAKE), tmp_path / "llama.log")


def run_eval(bundle, text, gguf, fake, log, vocab, out):
    env = dict(os.environ, PYTHONPATH=f"{fake}{os.pathsep}{ROOT}", FAKE_LLAMA_LOG=str(log), FAKE_LLAMA_VOCAB=str(vocab))
    return subprocess.run([sys.executable, "-m", "edgekv", "eval", str(bundle), "--text", str(text), "--ctx", "32",
                           "--chunks", "3", "--threads", "1", "--json", str(out), "--llama-cpp", str(gguf)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_llama_cpp_scored_on_the_same_windows(tiny_bundle_float, fake_llama, tmp_path):
    fake, gguf, log = fake_llama
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40 + "Pack my box with five dozen jugs. " * 40)
    b = load_bundle(tiny_bundle_float)
    vocab = b.model["vocab_size"]
    r = run_eval(tiny_bundle_float, text, gguf, fake, log, vocab, tmp_path / "out" / "eval.json")
    assert r.returncode == 0, r.stderr[-2000:]
    ids = TextCodec(b).encode(text.read_text())
    fed = [json.loads(line) for line in log.read_text().splitlines()]
    # first the probe in a child process (llama_cpp_bench --probe: a window of 9 of bench's tokens),
    # then three windows of 33 tokens from the start, no overlap; each fed whole but its last token, from position 0
    from edgekv.tools.bench import sample_tokens

    assert fed == [[0, sample_tokens(9, vocab)[:8]]] + [[0, ids[s: s + 32]] for s in (0, 33, 66)]
    res = json.loads((tmp_path / "out" / "eval.json").read_text())
    ref, lc = res["results"]
    assert ref["kld_mean"] == 0 and lc["label"] == "llama.cpp" and lc["weights"] == "gguf"
    # per window 16 scored tokens: 15 rows peak on their target, the call's last row is uniform
    hit = -math.log(math.exp(5.0) / (math.exp(5.0) + vocab - 1))
    assert lc["ppl"] == pytest.approx(math.exp((15 * hit + math.log(vocab)) / 16), rel=1e-5)
    assert lc["tokens_scored"] == ref["tokens_scored"] == 3 * 16
    assert lc["dppl_pct"] == pytest.approx(100 * (lc["ppl"] - ref["ppl"]) / ref["ppl"])
    assert lc["weights_mib"] == pytest.approx(4 / 2**20)  # the GGUF file's size
    assert "llama.cpp (model.gguf)" in r.stdout and math.isfinite(lc["kld_mean"]) and lc["kld_mean"] > 0


def test_another_models_gguf_is_one_line(tiny_bundle_float, fake_llama, tmp_path):
    fake, gguf, log = fake_llama
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    vocab = load_bundle(tiny_bundle_float).model["vocab_size"]
    r = run_eval(tiny_bundle_float, text, gguf, fake, log, vocab + 1, tmp_path / "eval.json")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "not the same model" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "eval.json").exists()


def test_a_gguf_llama_cpp_cannot_load_is_one_line(tiny_bundle_float, fake_llama, tmp_path):
    fake, gguf, log = fake_llama
    gguf.write_bytes(b"not a model")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    vocab = load_bundle(tiny_bundle_float).model["vocab_size"]
    r = run_eval(tiny_bundle_float, text, gguf, fake, log, vocab, tmp_path / "eval.json")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "cannot load model.gguf" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_llama_cpp_dying_of_sigill_ends_only_its_own_process(tiny_bundle_float, tmp_path):
    """eval scores llama.cpp in its own process, but runs it once in a child first: a build that
    dies of an illegal instruction is one error line, not eval killed by the signal."""
    from edgekv.tools.bench import LLAMA_CPP_FLAGS
    from tests.test_bench_llama_cpp import SIGILL_FAKE, fake_llama_package
    from tests.test_cli_errors import assert_clean_error

    folder, gguf = fake_llama_package(tmp_path, "sigill", SIGILL_FAKE)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    r = run_eval(tiny_bundle_float, text, gguf, folder, tmp_path / "unused.log", 384,
                 tmp_path / "out" / "eval.json")
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert_clean_error(r, "--llama-cpp: llama.cpp died of an illegal instruction (SIGILL)")
    assert f'CMAKE_ARGS="{LLAMA_CPP_FLAGS}"' in r.stderr
