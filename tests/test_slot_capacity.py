"""A slotted cache's bound is its slot, not its whole: serve --slots K gives each request C / K
cells, so C may pass the bundle's verified context as long as one slot does not (llama-server's
-c 8192 -np 4 on a 2048 model). The shared cell pool keeps the whole-cache bound: one sequence
may span all of it. Oracle: a request in one of three such slots = the same request in a cache
that is that one slot, logits bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")

from edgekv.errors import EdgeKVError  # noqa: E402
from edgekv.runtime.assemble import open_runtime  # noqa: E402
from edgekv.runtime.backends.fused import QUERY_LENGTHS_ORT, ort_at_least  # noqa: E402
from edgekv.runtime.batching import Batcher, Request  # noqa: E402
from edgekv.runtime.cache import KVCache  # noqa: E402
from tests.serving import run_until_done  # noqa: E402

pytestmark = pytest.mark.skipif(not ort_at_least(ort.__version__, QUERY_LENGTHS_ORT),
                                reason=f"onnxruntime {ort.__version__} has no GroupQueryAttention query_seqlens")


@pytest.fixture(scope="module")
def rt(tiny_bundle_int8_static):
    with open_runtime(tiny_bundle_int8_static, backend="ort-cpu", threads=1, attention="fused") as rt:
        yield rt


def run_in_slots(rt, slots: int, length: int, prompt: list[int], n: int) -> Request:
    cache = KVCache(rt.bundle, slots * length, memory=rt.backend.slot_memory(slots))
    eng = Batcher(rt.backend, cache, parallel=slots, prefill_chunk=32)
    r = Request(prompt, n, record_logits=True)
    eng.submit(r)
    run_until_done(eng, [r])
    return r


def test_slots_may_pass_the_verified_context_together(rt):
    limit = rt.bundle.max_context
    length = limit - limit // 4
    assert 3 * length > limit  # the whole cache is past the bound, each slot within it
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 300, length - 20)]
    three = run_in_slots(rt, 3, length, prompt, 12)
    one = run_in_slots(rt, 1, length, prompt, 12)
    assert three.finish_reason == one.finish_reason == "length" and len(three.out) == 12 and three.out == one.out
    np.testing.assert_array_equal(np.stack(three.logits), np.stack(one.logits))


def test_a_slot_past_the_verified_context_is_one_line(rt):
    limit = rt.bundle.max_context
    with pytest.raises(EdgeKVError, match=f"a sequence slot of {limit + 1} cells .* exceeds the {limit} tokens"):
        KVCache(rt.bundle, 2 * (limit + 1), memory=rt.backend.slot_memory(2))


def test_the_cell_pool_keeps_the_whole_cache_bound(rt):
    limit = rt.bundle.max_context
    with pytest.raises(EdgeKVError, match=f"a cache of {limit + 1} cells exceeds the {limit} tokens"):
        KVCache(rt.bundle, limit + 1, memory=rt.backend.memory)
