"""The runtime against its oracles: cached = uncached, chunked = token by token, in-place append."""
import numpy as np
import pytest

from edgekv.runtime.backends import OrtBackend
from edgekv.runtime.cache import KVCache
from edgekv.errors import ContextOverflow, EdgeKVError
from tests.stream_reference import Generator
from tests.stream_reference import Sequence
from tests.ring_reference import RingGenerator, RingSequence
from edgekv.format.bundle import load_bundle


def runtime(path, capacity=128, rows=64, chunk=256, sinks=None):
    """A Generator; with `sinks`, over the test-only ring (tests/ring_reference.py)."""
    b = load_bundle(path)
    cache = KVCache(b, capacity)
    backend = OrtBackend(b, threads=1, max_logits_rows=rows)
    if sinks is None:
        return Generator(backend, cache, prefill_chunk=chunk)
    seq = RingSequence(capacity, cache.max_positions)
    seq.enable_ring(sinks)
    return RingGenerator(backend, cache, seq, prefill_chunk=chunk)


def ids(n, seed=0, vocab=300):
    return list(np.random.default_rng(seed).integers(3, vocab, n))


def stream(path, capacity=128, chunk=256):
    """The product's own single stream (a one-request batcher run per call), on one thread."""
    from edgekv.runtime.assemble import open_runtime

    return open_runtime(path, capacity, "ort-cpu", 1, log=None).stream(prefill_chunk=chunk)


def test_float_cached_decode_equals_uncached_forward(tiny_bundle_float):
    """The product's stream, a prompt then a token a call, against the reference's one pass."""
    seq = ids(40)
    full = runtime(tiny_bundle_float).prefill(seq, all_logits=True)  # one pass, no past
    g = stream(tiny_bundle_float)
    cached = [g.prefill(seq[:10], all_logits=True)[-1].copy()]
    cached += [g.decode_step(t).copy() for t in seq[10:]]
    np.testing.assert_allclose(np.stack(cached), full[9:], atol=1e-4, rtol=1e-4)
    assert np.abs(full[9:] - full[8:-1]).max() > 1e-2  # logits do move from step to step


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_int8_chunked_prefill_equals_token_by_token(tiny_bundle_int8, chunk):
    """The product's stream prefilling in chunks against the reference, a token a call."""
    seq = ids(48, seed=2)
    one = runtime(tiny_bundle_int8, chunk=1).prefill(seq, all_logits=True)
    got = stream(tiny_bundle_int8, chunk=chunk).prefill(seq, all_logits=True)
    np.testing.assert_allclose(got, one, atol=2e-4, rtol=1e-4)


def test_present_is_written_in_place_and_nothing_reallocated(tiny_bundle_int8):
    g = runtime(tiny_bundle_int8)
    ptrs = {k: v.ctypes.data for k, v in g.cache.buffers.items()}
    g.prefill(ids(7))
    assert g.seq.n == 7
    for t in ids(5, seed=3):
        g.decode_step(t)
    assert g.seq.n == 12
    for k, buf in g.cache.buffers.items():
        assert buf.ctypes.data == ptrs[k]
        filled = np.abs(buf[:12].astype(np.float32)).reshape(12, -1).max(1)
        assert (filled > 0).all(), f"{k}: a slot the graph should have written is empty"
        assert not buf[12:].any(), f"{k}: written beyond the filled prefix"


def test_capacity_is_capped_and_overflow_is_an_error(tiny_bundle_int8):
    b = load_bundle(tiny_bundle_int8)
    with pytest.raises(EdgeKVError, match="verified for"):
        KVCache(b, b.max_context + 1)
    g = runtime(tiny_bundle_int8, capacity=16)
    with pytest.raises(ContextOverflow, match="context full"):
        g.prefill(ids(17))
    g.prefill(ids(16))
    with pytest.raises(ContextOverflow):
        g.decode_step(5)


def test_truncate_then_regenerate_matches(tiny_bundle_int8):
    g = runtime(tiny_bundle_int8)
    a = g.prefill(ids(20)).copy()
    g.decode_step(7)
    g.decode_step(8)
    g.truncate(19)
    assert g.seq.ids == ids(20)[:19] and g.seq.pos == g.seq.n == 19  # the ids and positions follow the slots
    b = g.prefill(ids(20)[19:]).copy()
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_logits_from_returns_exactly_the_tail_rows(tiny_bundle_int8):
    seq = ids(40, seed=4)
    full = runtime(tiny_bundle_int8, chunk=16).prefill(seq, all_logits=True)
    tail = stream(tiny_bundle_int8, chunk=16).prefill(seq, all_logits=True, logits_from=21)
    assert tail.shape == (19, full.shape[1])
    np.testing.assert_allclose(tail, full[21:], atol=1e-5)


@pytest.mark.parametrize("fixture", ["tiny_bundle_int8", "tiny_bundle_float"])
def test_ring_cache_equals_a_linear_cache_that_masks_evicted_tokens(fixture, request):
    """A ring of capacity C with k sinks, decoding past the wrap, must at every step give the
    logits of a large linear cache in which each step masks the tokens the ring has evicted
    (all but the sinks and the C - k - 1 most recent). Not a fresh prefill of the kept tokens:
    the kept tokens' deeper-layer K/V were computed while the evicted ones were still visible,
    in both caches alike."""
    path = request.getfixturevalue(fixture)
    C, k = 16, 3
    seq = ids(40, seed=5)
    ring = runtime(path, capacity=C, chunk=4, sinks=k)
    got = [ring.prefill(seq[:10]).copy()] + [ring.decode_step(t).copy() for t in seq[10:]]
    assert ring.seq.n == C and ring.seq.pos == len(seq)

    class Evicting(Sequence):
        """A linear sequence that masks what the ring has evicted by the time token `pos` is fed."""

        def key_mask(self, s, past=None):
            m = super().key_mask(s, past).copy()
            m[0, :, k: max(k, self.pos - (C - k - 1))] = False
            return m

    ref = runtime(path, capacity=64, chunk=4)
    ref = Generator(ref.backend, ref.cache, Evicting(64, ref.cache.max_positions), prefill_chunk=4)
    want = [ref.prefill(seq[:10]).copy()]
    for t in range(10, len(seq)):
        want.append(ref.decode_step(seq[t]).copy())
    # int8: the slots sit in another order, the float sums differ in the last bits, and now and
    # then an int8 rounding flips (docs/graph.md); a float cache matches to float precision
    atol = 1e-2 if "int8" in fixture else 2e-4
    np.testing.assert_allclose(np.stack(got), np.stack(want), atol=atol, rtol=1e-4)
    # and eviction matters: without the mask (everything visible) the logits differ far more
    full = runtime(path, capacity=64, chunk=4)
    full_logits = [full.prefill(seq[:10]).copy()] + [full.decode_step(t).copy() for t in seq[10:]]
    assert np.abs(np.stack(full_logits)[-5:] - np.stack(got)[-5:]).max() > 10 * atol
    with pytest.raises(ContextOverflow):  # a linear cache of the ring's size overflows
        runtime(path, capacity=C).prefill(seq)


def test_ring_prefill_crosses_the_wrap_and_refuses_undo(tiny_bundle_int8):
    g = runtime(tiny_bundle_int8, capacity=16, chunk=7, sinks=2)
    g.prefill(ids(50, seed=6))  # chunks are cut at the buffer's end
    assert g.seq.n == 16 and 2 <= g.seq.w < 16 and g.seq.pos == 50
    with pytest.raises(ValueError, match="wrapped"):
        g.truncate(4)
    # a wrapped ring is saved with its write slot and continues the same after a restore
    snap, w = g.snapshot(), g.seq.w
    h = runtime(tiny_bundle_int8, capacity=16, chunk=7, sinks=2)
    h.restore(snap, g.seq.ids, w=w)
    assert h.seq.pos == g.seq.pos
    for t in ids(5, seed=7):
        np.testing.assert_array_equal(h.decode_step(t), g.decode_step(t))
    linear = runtime(tiny_bundle_int8, capacity=16)
    with pytest.raises(EdgeKVError, match="token ids"):  # a single stream never wraps: slot i holds token i
        linear.restore(snap, g.seq.ids)


def test_an_interrupted_prefill_is_undone_whole(tiny_bundle_int8):
    """Ctrl-C inside a graph call of a stream (the batcher's one-request run): the run is undone
    whole, so the sequence holds what it held before and feeding the prompt again gives the
    logits of an uninterrupted prefill."""
    from edgekv.runtime.assemble import open_runtime

    seq = ids(30, seed=8)
    with open_runtime(tiny_bundle_int8, 128, "ort-cpu", 1, max_logits_rows=64, log=None) as rt:
        s = rt.stream(prefill_chunk=8)
        s.prefill(seq[:3])
        run, calls = rt.backend.run_cells, []

        def interrupt_second_call(*a):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return run(*a)

        rt.backend.run_cells = interrupt_second_call
        with pytest.raises(KeyboardInterrupt):
            s.prefill(seq[3:])
        assert (s.seq.n, s.seq.pos, s.seq.ids) == (3, 3, seq[:3]) and len(calls) == 2
        rt.backend.run_cells = run
        resumed = s.prefill(seq[3:]).copy()
    np.testing.assert_allclose(resumed, runtime(tiny_bundle_int8, chunk=8).prefill(seq), atol=1e-5)


@pytest.mark.parametrize("ring", [False, True])
def test_a_call_never_runs_past_the_verified_positions(ring):
    """Positions stop at the bundle's verified context, for a linear sequence whose slots would
    still have room and for a ring (whose slots never run out): exactly that many, not one more."""
    seq = (RingSequence if ring else Sequence)(capacity=64 if not ring else 16, max_positions=20)
    if ring:
        seq.enable_ring(4)
    seq.advance(list(range(12)))
    seq.check_room(8)
    assert seq.room() == 8
    with pytest.raises(ContextOverflow, match="positions"):
        seq.check_room(9)


def test_a_stream_takes_exactly_its_room(tiny_bundle_int8):
    """A stream (eval's, bench's) refuses a prompt one token longer than the cells left, in one
    line and before anything is fed, and takes one that fills them exactly."""
    from edgekv.runtime.assemble import open_runtime

    with open_runtime(tiny_bundle_int8, 32, "ort-cpu", 1, log=None) as rt:
        s = rt.stream()
        s.prefill(ids(20, seed=3))
        with pytest.raises(ContextOverflow, match="13 tokens do not fit: 12 of the cache's 32 are left"):
            s.prefill(ids(13, seed=4))
        assert s.seq.n == 20 and s.seq.room() == 12
        assert s.prefill(ids(12, seed=4)).shape == (rt.bundle.model["vocab_size"],)
        assert s.seq.n == 32 and s.seq.room() == 0


@pytest.mark.parametrize("fixture", ["tiny_bundle_int8", "tiny_bundle_int8_static"])
def test_a_finished_streams_cache_is_freed_with_it(fixture, request):
    """The backend binds a stream's cache by address; once the stream is dropped its buffers go
    too (bench and eval open one stream per capacity: each would otherwise stay until the next
    bound), and a new stream on the same backend runs as the first did."""
    import weakref

    from edgekv.runtime.assemble import open_runtime

    with open_runtime(request.getfixturevalue(fixture), 64, "ort-cpu", 1, log=None) as rt:
        s = rt.stream()
        first = s.prefill(ids(10, seed=5))
        s.decode_step(7)
        cache = weakref.ref(s.cache)
        del s
        assert cache() is None
        again = rt.stream()
        np.testing.assert_array_equal(again.prefill(ids(10, seed=5)), first)
