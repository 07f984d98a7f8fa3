"""Guards, each at its boundary so that removing or loosening it fails a test: the engine chooser,
the bundle's file sizes, free memory before the KV cache is allocated, the context limits."""
import json

import numpy as np
import pytest

from edgekv.errors import BundleError, EdgeKVError
from edgekv.format.bundle import load_bundle
from edgekv.runtime.backends.engines import META, PLAN, PROFILES_VERSION, bundle_fingerprint, engine_key, find_engine
from edgekv.runtime.cache import KVCache
from edgekv.runtime.memory import HostMemory
from edgekv.runtime.text import TextCodec
from tests.conftest import cli


# -- the engine chooser: the smallest fresh engine that covers the cache -----------------------

def plant_engine(b, ctx, fresh=True):
    folder = b.path / "engines" / engine_key("Orin", "10.3.0", ctx, 128)
    folder.mkdir(parents=True)
    (folder / PLAN).write_bytes(b"plan")
    fp = bundle_fingerprint(b) if fresh else "0" * 16
    (folder / META).write_text(json.dumps({"bundle_fingerprint": fp, "profiles_version": PROFILES_VERSION, "ctx": ctx,
                                           "max_prefill": 128}))
    return folder


def test_engine_chooser_picks_the_smallest_that_fits(bundle_copy):
    b = load_bundle(bundle_copy)
    # names sort as ctx1024 < ctx2048 < ctx384 < ctx512: neither the first nor the last listed is right
    engines = {c: plant_engine(b, c) for c in (1024, 2048, 384, 512)}
    plant_engine(b, 320, fresh=False)  # would fit best, but built from another bundle
    assert find_engine(b, "Orin", "10.3.0", 300)[0] == engines[384]
    assert find_engine(b, "Orin", "10.3.0", 384)[0] == engines[384]  # an exact fit
    assert find_engine(b, "Orin", "10.3.0", 385)[0] == engines[512]
    assert find_engine(b, "Orin", "10.3.0", 1500)[0] == engines[2048]
    assert find_engine(b, "Orin", "10.3.0", 2049) is None


# -- the bundle's file sizes -------------------------------------------------------------------

@pytest.mark.parametrize("change", ["shorter", "longer", "missing"])
def test_bundle_file_size_check(bundle_copy, change):
    man = json.loads((bundle_copy / "edgekv.json").read_text())
    assert man["files"]["sizes"], "the manifest records its files' sizes"
    key = next(iter(man["files"]["sizes"]))
    load_bundle(bundle_copy)  # intact so far
    f = bundle_copy / key
    if change == "missing":
        f.unlink()
    else:
        data = f.read_bytes()
        f.write_bytes(data[:-1] if change == "shorter" else data + b"\0")
    with pytest.raises(BundleError, match=f"corrupt bundle \\({key} is"):
        load_bundle(bundle_copy)


def test_every_recorded_file_is_checked(bundle_copy):
    man = json.loads((bundle_copy / "edgekv.json").read_text())
    for key, size in man["files"]["sizes"].items():
        f = bundle_copy / key
        data = f.read_bytes()
        assert len(data) == size
        f.write_bytes(data + b"\0")
        with pytest.raises(BundleError, match="manifest says"):
            load_bundle(bundle_copy)
        f.write_bytes(data)
    load_bundle(bundle_copy)


# -- free memory before the KV cache is allocated --------------------------------------------

class SmallMemory(HostMemory):
    """Host memory that reports `free` bytes and counts allocations."""

    def __init__(self, free):
        self.free, self.allocs = free, 0

    def free_bytes(self):
        return self.free

    def alloc(self, shape, dtype):
        self.allocs += 1
        return super().alloc(shape, dtype)


def test_free_memory_checked_before_allocating(tiny_bundle_int8):
    b = load_bundle(tiny_bundle_int8)
    ctx = 64
    need = b.kv_bytes_per_token() * ctx  # the scheme's bytes per token (docs/kv-schemes.md), times the slots
    short = SmallMemory(need - 1)
    with pytest.raises(EdgeKVError, match="only .* MiB free on cpu"):
        KVCache(b, ctx, memory=short)
    assert short.allocs == 0  # refused before anything was allocated
    enough = SmallMemory(need)
    c = KVCache(b, ctx, memory=enough)
    assert c.nbytes == need and enough.allocs == len(c.buffers)
    KVCache(b, ctx, memory=SmallMemory(None))  # unknown free memory: no guess, no refusal


# -- context limits ----------------------------------------------------------------------------

def test_ctx_up_to_the_verified_context(tiny_bundle_int8):
    b = load_bundle(tiny_bundle_int8)
    assert KVCache(b, b.max_context).capacity == b.max_context
    with pytest.raises(EdgeKVError, match="verified for"):
        KVCache(b, b.max_context + 1)
    with pytest.raises(EdgeKVError, match="at least 1"):
        KVCache(b, 0)


def test_generate_prompt_must_leave_a_slot(tiny_bundle_int8):
    text = "The capital of France is Paris. Tell me about trains and tea."
    n = len(TextCodec(load_bundle(tiny_bundle_int8)).encode(text))
    r = cli("generate", tiny_bundle_int8, text, "--raw", "--ctx", n, "--max-new-tokens", 2)
    assert r.returncode != 0 and f"prompt is {n} tokens, the cache holds {n}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = cli("generate", tiny_bundle_int8, text, "--raw", "--ctx", n + 1, "--max-new-tokens", 2)
    assert r.returncode == 0, r.stderr


def test_eval_refuses_ctx_beyond_the_verified_context(tiny_bundle_int8, tmp_path):
    corpus = tmp_path / "t.txt"
    corpus.write_text("The capital of France is Paris. " * 200)
    b = load_bundle(tiny_bundle_int8)
    r = cli("eval", tiny_bundle_int8, "--text", corpus, "--ctx", b.max_context + 1)
    assert r.returncode != 0 and "verified context" in r.stderr and "Traceback" not in r.stderr, r.stderr
