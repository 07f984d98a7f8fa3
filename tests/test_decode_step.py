"""The constant-overhead decode step (edgekv/runtime/backends/ort.py): the past bound at a bucket
with its tail masked gives what binding exactly the filled slots gives, whatever the tail holds,
and a decode step inside a bucket binds nothing."""
import numpy as np
import pytest

from edgekv.format.bundle import load_bundle
from edgekv.runtime.backends import OrtBackend
from edgekv.runtime.cache import KVCache
from tests.stream_reference import Generator


def runtime(path, bucket, capacity=96, chunk=8):
    b = load_bundle(path)
    return Generator(OrtBackend(b, threads=1, past_bucket=bucket), KVCache(b, capacity), prefill_chunk=chunk)


def ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


def decode_run(g, seq, split):
    out = [g.prefill(seq[:split]).copy()]
    out += [g.decode_step(t).copy() for t in seq[split:]]
    return np.stack(out)


@pytest.mark.parametrize("fixture", ["tiny_bundle_float", "tiny_bundle_int8"])
def test_bucketed_past_equals_the_exact_past_even_over_a_stale_tail(fixture, request):
    path = request.getfixturevalue(fixture)
    seq = ids(60, seed=4)
    exact = runtime(path, bucket=1)
    want = decode_run(exact, seq, 13)
    for bucket in (16, 128):
        g = runtime(path, bucket=bucket)
        # slots past the filled ones hold another conversation's K/V: the mask must hide them exactly
        g.prefill(ids(90, seed=9))
        g.reset()
        got = decode_run(g, seq, 13)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        for name, buf in g.cache.buffers.items():  # and the same cache was written (float sums may
            a, b = buf[:60].astype(np.float32), exact.cache.buffers[name][:60].astype(np.float32)
            if buf.dtype == np.int8:  # differ in the last bits, and now and then flip an int8 rounding)
                assert np.abs(a - b).max() <= 1 and (a == b).mean() > 0.99
            else:
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    # the stale tail would matter if it were seen: unmasked, the same run differs
    assert np.abs(want[1:] - want[:-1]).max() > 1e-2


def test_a_decode_step_inside_a_bucket_binds_nothing(tiny_bundle_int8):
    g = runtime(tiny_bundle_int8, bucket=32)
    binds = []

    class CountingBinding:
        def __init__(self, io):
            self.io = io

        def __getattr__(self, name):
            f = getattr(self.io, name)
            return (lambda *a, **k: (binds.append(a[0]), f(*a, **k))[1]) if name.startswith("bind") else f

    g.backend.binding.io = CountingBinding(g.backend.binding.io)
    tok = int(np.argmax(g.prefill(ids(5))))
    g.decode_step(tok)  # the first step binds its shapes
    binds.clear()
    for _ in range(20):  # slots 6..26: still the first bucket of 32
        tok = int(np.argmax(g.decode_step(tok)))
    assert binds == []
    for _ in range(10):  # into the second bucket: the past and the mask are bound again, once
        tok = int(np.argmax(g.decode_step(tok)))
    past = [n for n in binds if n.startswith("past.")]
    assert len(past) == len(g.cache.names) and "key_mask" in binds and not any(n.startswith("present.") for n in binds)


def test_a_past_binding_interrupted_half_way_is_redone_at_the_next_call(tiny_bundle_int8, monkeypatch):
    """Ctrl-C while the past is being rebound (chat: any line) leaves some tensors at the new
    length: the next call must not take the binding for done (it failed in onnxruntime with a
    broadcast error between the two lengths)."""
    seq = ids(30, seed=3)
    want = decode_run(runtime(tiny_bundle_int8, bucket=16), seq, 20)
    g = runtime(tiny_bundle_int8, bucket=16)
    got = [g.prefill(seq[:20]).copy(), g.decode_step(seq[20]).copy()]  # the past is bound at 32 now
    calls, ptr = [0], g.cache.ptr

    def interrupted(name, slot):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return ptr(name, slot)
    monkeypatch.setattr(g.cache, "ptr", interrupted)
    with pytest.raises(KeyboardInterrupt):
        g.backend.binding.past(g.cache, 48)  # interrupted while binding a longer past
    monkeypatch.setattr(g.cache, "ptr", ptr)
    got += [g.decode_step(t).copy() for t in seq[21:]]  # past 32 again
    np.testing.assert_allclose(np.stack(got), want, atol=1e-5, rtol=1e-5)
