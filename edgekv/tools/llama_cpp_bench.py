"""llama.cpp (llama-cpp-python) timed the way `edgekv bench` times a bundle: the same token ids
(bench.sample_tokens), prompt lengths, decode tokens, threads and rounds, through the same
measure_runs. `edgekv bench --llama-cpp GGUF` runs it in a subprocess, so that neither process's
peak RSS holds the other's memory; it prints one JSON line (its "cpu": the CPU it ran on).

  python -m edgekv.tools.llama_cpp_bench GGUF --threads 2 --n-ctx 4096 --prompt-lengths 64,1024,1800 --vocab 49152

`edgekv eval --llama-cpp` scores llama.cpp in its own process, but first runs `--probe` here: the
same load and one short window in a child process, so that a llama.cpp build that dies of an
illegal instruction kills the child, and eval says so in one line (bench.peer_failure).

llama-cpp-python is a bench extra, never a runtime dependency (pyproject `bench`)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from edgekv.errors import EdgeKVError
from edgekv.tools.bench import measure_runs, sample_tokens
from edgekv.tools.host import rss_bytes
from edgekv.runtime.cpu import cpu_field


class LlamaCppStream:
    """A llama_cpp.Llama behind the stream calls measure_runs makes; each call returns the
    last token's logits as a view, like edgekv's (Llama.eval keeps no logits unless logits_all)."""

    def __init__(self, llama_cpp, llm):
        self.lib, self.llm = llama_cpp, llm
        self.vocab = llm.n_vocab()

    def reset(self) -> None:
        self.llm.reset()  # the next eval starts at position 0 and drops the cache from there

    def _last_logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.vocab,))

    def prefill(self, ids: list[int]) -> np.ndarray:
        self.llm.eval(ids)
        return self._last_logits()

    def decode_step(self, token: int) -> np.ndarray:
        self.llm.eval([token])
        return self._last_logits()


def without_extra_bufts(llama_cpp) -> None:
    """Make Llama load its weights with use_extra_bufts off (Llama() has no argument for it):
    on some virtual machines the CPU reports AMX but ggml's AMX kernels, which the extra buffer
    types select, crash (docs/benchmarks.md)."""
    lib = llama_cpp.llama_cpp  # the ctypes module Llama.__init__ calls it through
    default = lib.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--n-ctx", type=int, required=True)
    ap.add_argument("--prompt-lengths", default="", help="comma-separated (required unless --probe)")
    ap.add_argument("--vocab", type=int, required=True, help="the bundle's vocabulary (sample_tokens draws from it)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--n-batch", type=int, default=512, help="prompt tokens per call (llama.cpp's own default)")
    ap.add_argument("--no-extra-bufts", action="store_true",
                    help="load the weights without ggml's extra buffer types (repacked / AMX layouts)")
    ap.add_argument("--probe", action="store_true",
                    help="load GGUF and score one short window as `edgekv eval --llama-cpp` does, then exit 0")
    a = ap.parse_args(argv)
    if a.probe:
        return probe(a.gguf, a.n_ctx, a.threads, a.vocab)
    if not a.prompt_lengths:
        ap.error("--prompt-lengths is required")
    import llama_cpp

    if a.no_extra_bufts:
        without_extra_bufts(llama_cpp)

    llm = llama_cpp.Llama(model_path=a.gguf, n_ctx=a.n_ctx, n_batch=a.n_batch, n_threads=a.threads,
                          n_threads_batch=a.threads, verbose=False)
    gen = LlamaCppStream(llama_cpp, llm)
    lens = [int(x) for x in a.prompt_lengths.split(",")]
    runs = measure_runs({(a.n_ctx, L): gen for L in lens}, a.vocab, a.decode_tokens, a.repeat)
    print(json.dumps({"llama_cpp_version": getattr(llama_cpp, "__version__", "?"), "gguf": a.gguf,
                      "extra_bufts": not a.no_extra_bufts,
                      "threads": a.threads, "cpu": cpu_field(a.threads), "n_ctx": a.n_ctx, "runs": list(runs.values()),
                      "peak_rss_mib": rss_bytes()[1] / 2**20}))


def load_for_scoring(gguf: Path, ctx: int, threads: int | None, vocab: int):
    """llama.cpp loaded as eval scores with it (every position's logits), checked against the bundles' vocabulary."""
    import llama_cpp

    without_extra_bufts(llama_cpp)
    try:
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=ctx, n_batch=512, n_threads=threads or None,
                              logits_all=True, verbose=False)
    except (ValueError, RuntimeError, OSError) as e:  # what llama-cpp-python raises for a file it cannot load
        raise EdgeKVError(f"--llama-cpp: llama.cpp cannot load {gguf.name} ({str(e).splitlines()[0][:200]})") from None
    if llm.n_vocab() != vocab:
        raise EdgeKVError(f"--llama-cpp: {gguf.name} has a vocabulary of {llm.n_vocab()}, the bundles {vocab}: "
                          "not the same model")
    return llm


def probe(gguf: str, n_ctx: int, threads: int, vocab: int) -> None:
    """eval's llama.cpp path (load_for_scoring, then one window of a few tokens)."""
    ids = sample_tokens(min(n_ctx, 8) + 1, vocab)
    llm = load_for_scoring(Path(gguf), n_ctx, threads or None, vocab)
    llm.reset()
    llm.eval(ids[:-1])


if __name__ == "__main__":
    main()
