"""Gemma 3 text exported and run (docs/models.md): the graph's second mask input, local_key_mask,
built by the runtime from each key cell's position, against transformers (generate, a kept
chat sequence over turns), against the same runtime alone (a serving batch), against a ring
oracle whose slots remember their positions (chat's ring, wrapped), and the backends that feed
it (trt's stand-in, the fused rewrite). The tiny checkpoint's window is 8:
every prompt and reply here runs well past it."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from edgekv.errors import BundleError
from edgekv.format.bundle import LOCAL_MASK, load_bundle
from edgekv.runtime.assemble import open_runtime
from edgekv.runtime.backends import OrtBackend
from edgekv.runtime.batching import Request
from edgekv.runtime.cache import KVCache
from tests.stream_reference import Generator, new_sequence, reference
from tests.archs import GEMMA_PARITY_STEPS
from tests.conftest import chat_engine
from tests.ring_reference import RingGenerator, RingSequence

CONTEXT = 128
WINDOW = 8  # tests/archs.py's gemma3


def ids(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 380, n)]


@pytest.fixture(scope="module")
def folder(arch_folders):
    return arch_folders("gemma3")


@pytest.fixture(scope="module")
def bundles(arch_bundles):
    """kv -> the tiny Gemma 3 exported with it (conftest's arch_bundles, shared with
    test_fused_gemma3: export_bundle raises unless parity, over a prompt and 32 decode steps past
    the window, and check-trt pass)."""
    return lambda kv: arch_bundles("gemma3", kv, CONTEXT, steps=GEMMA_PARITY_STEPS)


@pytest.fixture(scope="module")
def hf(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def hf_greedy(hf, prompt, n):
    """transformers' greedy tokens after `prompt` and the logits each was taken from."""
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), np.stack([s[0].numpy() for s in out.scores])


def greedy(gen, prompt, n):
    logits = gen.prefill(prompt).copy()
    toks, rows = [], []
    for _ in range(n):
        rows.append(logits)
        toks.append(int(np.argmax(logits)))
        logits = gen.decode_step(toks[-1]).copy()
    return toks, np.stack(rows)


# -- the bundle ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kv", ["float", "int8"])
def test_the_bundle_records_its_local_layers_and_passed_parity_past_the_window(kv, bundles):
    b = load_bundle(bundles(kv))
    m = b.manifest
    assert m["format_version"] == 4 and m["model"]["local_layers"] == [0, 1] and m["model"]["sliding_window"] == WINDOW
    assert m["io"]["inputs"][-1] == LOCAL_MASK and b.window == WINDOW
    assert m["parity"]["passed"] and m["trt_check"] == {"10.3": "pass"}
    assert m["parity"]["prompt_tokens"] > 2 * WINDOW and m["parity"]["decode_steps"] == GEMMA_PARITY_STEPS
    import onnx

    graph = onnx.load(str(b.onnx_path), load_external_data=False)
    assert LOCAL_MASK in [i.name for i in graph.graph.input]


def test_a_manifest_whose_local_layers_do_not_fit_is_refused(bundles, tmp_path):
    for change in ({"local_layers": [0, 7]}, {"sliding_window": None}, {"local_layers": []}):
        dst = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(bundles("float"), dst)
        man = json.loads((dst / "edgekv.json").read_text())
        man["model"].update(change)
        (dst / "edgekv.json").write_text(json.dumps(man))
        with pytest.raises(BundleError, match="corrupt manifest"):  # ([] leaves io naming an input no layer has)
            load_bundle(dst)


# -- the runtime against transformers ---------------------------------------------------------

def test_generate_follows_transformers_greedy_past_the_window(bundles, hf):
    """The float-KV bundle through the runtime: transformers' 40 greedy tokens after a 12-token
    prompt and its logits at every step (positions 12..51, window 8)."""
    prompt = ids(12, 1)
    want, want_rows = hf_greedy(hf, prompt, 40)
    with open_runtime(bundles("float"), CONTEXT, "ort-cpu", threads=1) as rt:
        got, rows = greedy(reference(rt), prompt, 40)
    assert got == want
    np.testing.assert_allclose(rows, want_rows, atol=1e-4, rtol=1e-4)


def test_int8_bundle_follows_transformers_greedy_past_the_window(bundles, hf):
    """int8 KV: transformers' greedy tokens, a different one only at a near-tie within the
    bundle's parity tolerance (its quantization noise), nothing compared after it."""
    b = load_bundle(bundles("int8"))
    prompt = ids(12, 2)
    want, scores = hf_greedy(hf, prompt, 32)
    with open_runtime(b.path, CONTEXT, "ort-cpu", threads=1) as rt:
        got, _ = greedy(reference(rt), prompt, 32)
    for i, (a, c) in enumerate(zip(want, got)):
        if a != c:
            assert scores[i][a] - scores[i][c] <= b.logits_tolerance(), (i, want, got)
            break
    else:
        assert got == want


def test_a_kept_chat_sequence_follows_transformers_over_turns(bundles, hf):
    """Chat's way through the batcher: one kept sequence, three turns (a prompt, greedy reply);
    each reply = transformers' greedy continuation of the whole history the sequence holds."""
    b = load_bundle(bundles("float"))
    e = chat_engine(OrtBackend(b, threads=1), b, CONTEXT, chunk=8)
    seq = e.hold()
    for turn in range(3):
        history = seq.ids + (prompt := ids(10, 10 + turn))
        req = e.run(Request(prompt, 12, seq=seq))
        assert req.out == hf_greedy(hf, history, 12)[0], turn
    assert seq.pos > 4 * WINDOW


def test_a_serving_batch_of_two_equals_each_alone(bundles):
    """Two requests decoded together over one pool (the second joining while the first decodes,
    so their cells interleave) = each decoded alone: greedy tokens and logits to float rounding."""
    with open_runtime(bundles("float"), CONTEXT, "ort-cpu", threads=1) as rt:
        engine = rt.batcher(capacity=CONTEXT, parallel=2, prefill_chunk=8)
        a, c = Request(ids(11, 3), 24, record_logits=True), Request(ids(19, 4), 20, record_logits=True)
        engine.submit(a)
        for _ in range(3):
            engine.step()
        engine.submit(c)
        while not (a.finish_reason and c.finish_reason):
            engine.step()
        for req in (a, c):
            toks, rows = greedy(reference(rt, capacity=CONTEXT), req.prompt, len(req.out))
            assert req.out == toks
            np.testing.assert_allclose(np.stack(req.logits), rows, atol=1e-4, rtol=1e-4)


class WindowRing(RingSequence):
    """The test-only single-stream ring (tests/ring_reference.py), its slots remembering the
    position each holds: the local mask from those (the oracle of the batcher's cell positions)."""

    def __init__(self, capacity, max_positions, window):
        super().__init__(capacity, max_positions)
        self.window, self.slot_pos = window, np.zeros(capacity, np.int64)

    def advance(self, ids):
        self.slot_pos[self.w: self.w + len(ids)] = np.arange(self.pos, self.pos + len(ids))
        super().advance(ids)

    def local_key_mask(self, s, past=None):
        m = self.key_mask(s, past).copy()
        p = m.shape[2] - s
        q = np.arange(self.pos, self.pos + s)
        keys = np.concatenate([self.slot_pos[:p], q])
        m[0] &= q[:, None] - keys[None, :] < self.window
        return m


@pytest.mark.parametrize("windowed", [True, False])
def test_chat_ring_wrapped_equals_the_ring_oracle_token_by_token(bundles, windowed):
    """A kept ring of 20 cells (4 sinks) fed 70 tokens one per call, then decoding: its logits =
    the single-stream ring's whose slots know their positions, at every step (float KV), with
    the local layers in their own ring (windowed, chat's) or in the cells (the full pool)."""
    b = load_bundle(bundles("float"))
    ctx, sinks = 20, 4
    e = chat_engine(OrtBackend(b, threads=1, past_bucket=1), b, ctx, chunk=1, windowed=windowed, margin=0)
    assert (e.cache.local_ring is not None) == windowed  # a ring of 7 beside 20 cells
    seq = e.hold()
    seq.enable_ring(sinks)
    ring = WindowRing(ctx, b.max_context, b.window)
    ring.enable_ring(sinks)
    g = RingGenerator(OrtBackend(b, threads=1, past_bucket=1), KVCache(b, ctx), ring, prefill_chunk=1)
    prompt = ids(70, 5)
    req = e.run(Request(prompt, 16, seq=seq, record_logits=True))
    assert seq.wrapped
    want, rows = greedy(g, prompt, 16)
    assert req.out == want
    np.testing.assert_allclose(np.stack(req.logits), rows, atol=1e-5, rtol=1e-5)


# -- the windowed cache (format 4): the local layers keep only their last W - 1 positions ------

def run_both(b, prompt, steps, chunk, windowed):
    """Greedy over a cache of CONTEXT cells, windowed or full (the same backend and past bucket)."""
    g = Generator(OrtBackend(b, threads=1, past_bucket=4), KVCache(b, CONTEXT, windowed=windowed), prefill_chunk=chunk)
    return greedy(g, prompt, steps), g


@pytest.mark.parametrize("kv, chunk", [("float", 3), ("float", 16), ("int8", 5)])
def test_a_windowed_cache_equals_the_full_cache_past_the_window(bundles, kv, chunk):
    """A cache whose local layers hold 7 slots (window 8) = the full cache, whose local_key_mask
    masks the out-of-window keys: the same greedy tokens and logits over a 30-token prompt fed in
    chunks that wrap the ring (3, 5) or outgrow it (16), then 40 decode steps (positions to 70)."""
    b = load_bundle(bundles(kv))
    prompt = ids(30, 20)
    (want, want_rows), full = run_both(b, prompt, 40, chunk, windowed=False)
    (got, rows), win = run_both(b, prompt, 40, chunk, windowed=True)
    assert win.cache.local_ring == WINDOW - 1 and full.cache.local_ring is None
    assert {win.cache.buffers[n].shape[0] for n in win.cache.local_names} == {WINDOW - 1}
    assert len(win.cache.local_names) == 2 * len(b.local_layers) * len(b.scheme.tensors)
    assert got == want
    np.testing.assert_allclose(rows, want_rows, atol=1e-5, rtol=1e-5)


def test_the_windowed_cache_reports_its_bytes(bundles):
    """The cache's bytes = the manifest's: the global layer's per token plus the local layers'
    fixed ring; the stats line says the local layers keep their last 7 and counts those bytes."""
    from edgekv.runtime.stats import kv_line

    b = load_bundle(bundles("int8"))
    kv = b.manifest["kv"]
    full, win = KVCache(b, CONTEXT), KVCache(b, CONTEXT, windowed=True)
    assert kv["local_slots"] == WINDOW - 1
    assert (win.bytes_per_token, win.local_bytes) == (kv["global_bytes_per_token"], kv["local_bytes"]) \
        == b.windowed_kv_bytes()
    assert full.bytes_per_token == kv["bytes_per_token"] == b.kv_bytes_per_token() and full.local_bytes == 0
    assert win.nbytes == CONTEXT * kv["global_bytes_per_token"] + kv["local_bytes"] < full.nbytes
    # the tiny model: 2 of its 3 layers local, so at CONTEXT the windowed cache is about a third of the full one
    assert win.nbytes / full.nbytes < 0.4
    seq = new_sequence(win)
    seq.advance(ids(3))
    assert win.used_bytes(3) == 3 * kv["global_bytes_per_token"] + 3 * kv["local_bytes"] // (WINDOW - 1)
    seq.advance(ids(20))
    assert win.used_bytes(23) == 23 * kv["global_bytes_per_token"] + kv["local_bytes"]
    line = kv_line(win, seq)
    assert line.startswith(f"KV 23/{CONTEXT} cells (local layers: last {WINDOW - 1}), ") and "MiB" in line
    assert "local layers" not in kv_line(full, new_sequence(full))


def test_eval_reports_the_bytes_of_the_windowed_cache_it_ran(bundles):
    """`edgekv eval`'s bytes per token for a windowed bundle: what its cache holds per token at
    the window length (the global layer's, and the local ring spread over ctx), not the full cache's."""
    from edgekv.tools.evaluate import evaluate

    b = load_bundle(bundles("int8"))
    text = "The capital of France is Paris. " * 80
    res = evaluate([str(bundles("float")), str(b.path)], text, ctx=64, chunks=2)
    got = {r["scheme"]: r["kv_bytes_per_token"] for r in res["results"]}
    assert got["int8"] == round(KVCache(b, 64, windowed=True).nbytes / 64) < b.kv_bytes_per_token()


def test_the_runtime_runs_generate_windowed_and_a_batcher_full(bundles):
    """Which paths take the windowed cache: a stream (generate, eval, bench, the parity check) on
    ort-cpu's graph as written keeps one ring of W - 1 slots; a batcher asked for every position
    and the fused graph keep every position for the local layers."""
    with open_runtime(bundles("int8"), CONTEXT, "ort-cpu", threads=1, attention="plain") as rt:
        assert rt.stream().cache.local_ring == WINDOW - 1
        assert rt.batcher(capacity=CONTEXT).kv.cache.local_ring is None
    with open_runtime(bundles("float"), CONTEXT, "ort-cpu", threads=1, attention="fused") as rt:
        assert rt.stream().cache.local_ring is None


def test_a_windowed_sequence_truncates_only_what_its_ring_still_holds(bundles):
    """Undo within the ring = the full cache's; past it (the local slots were overwritten) one
    clear error, and the sequence is unchanged; a windowed cache has no cells to snapshot."""
    from edgekv.errors import EdgeKVError

    b = load_bundle(bundles("float"))
    full, win = (Generator(OrtBackend(b, threads=1), KVCache(b, CONTEXT, windowed=w), prefill_chunk=8)
                 for w in (False, True))
    for g in (full, win):
        g.prefill(ids(5, 21))
        g.truncate(3)
    assert g.seq.n == 3
    a, c = full.decode_step(7).copy(), win.decode_step(7).copy()
    np.testing.assert_allclose(c, a, atol=1e-5, rtol=1e-5)
    win.prefill(ids(10, 22))
    with pytest.raises(EdgeKVError, match="cannot truncate 14 tokens to 12"):
        win.truncate(12)
    assert win.seq.n == 14
    with pytest.raises(EdgeKVError, match="windowed cache"):
        win.snapshot()


def test_an_older_bundle_keeps_every_position_for_its_local_layers(bundles, tmp_path):
    """A version-3 manifest (its graph may tie the local past to the global one) runs with the
    full cache, as before; a version-4 one whose local slots disagree with its window is refused."""
    dst = tmp_path / "v3"
    shutil.copytree(bundles("float"), dst)
    man = json.loads((dst / "edgekv.json").read_text())
    man["format_version"] = 3
    for k in ("local_slots", "global_bytes_per_token", "local_bytes"):
        del man["kv"][k]
    (dst / "edgekv.json").write_text(json.dumps(man))
    b = load_bundle(dst)
    assert not b.windowed and b.windowed_kv_bytes() == (b.kv_bytes_per_token(), 0)
    with open_runtime(b, CONTEXT, "ort-cpu", threads=1) as rt:
        g = reference(rt)
        assert g.cache.local_ring is None and g.cache.local_names == []
        want, _ = run_both(load_bundle(bundles("float")), ids(12, 23), 12, 8, windowed=True)[0]
        assert greedy(g, ids(12, 23), 12)[0] == want
    man["format_version"], man["kv"]["local_slots"] = 4, WINDOW
    (dst / "edgekv.json").write_text(json.dumps(man))
    with pytest.raises(BundleError, match="kv.local_slots"):
        load_bundle(dst)


def test_the_graph_gives_the_local_past_its_own_dimension(bundles):
    """check-trt passed the export (test above); the local layers' past and local_key_mask are
    named by their own dimension, the global layer's by `past`."""
    import onnx

    b = load_bundle(bundles("int8"))
    g = onnx.load(str(b.onnx_path), load_external_data=False).graph
    first = {i.name: i.type.tensor_type.shape.dim[0].dim_param for i in g.input if i.name.startswith("past.")}
    assert {first[n] for n in first if int(n.split(".")[1]) in b.local_layers} == {"local_past"}
    assert {first[n] for n in first if int(n.split(".")[1]) not in b.local_layers} == {"past"}
    mask = next(i for i in g.input if i.name == LOCAL_MASK)
    assert mask.type.tensor_type.shape.dim[2].dim_param == "local_total"


# -- the windowed pool (chat): a ring of the local layers' slots per sequence -----------------

def windowed_chat(b, margin=0, chunk=8, ctx=CONTEXT):
    """chat's batcher over a windowed pool whose rings hold W - 1 + margin slots (0: as tight as
    generate's, so every turn here wraps them)."""
    from edgekv.runtime.batching import Batcher

    cache = KVCache(b, ctx, windowed=True, rings=2, margin=margin)
    return Batcher(OrtBackend(b, threads=1), cache, parallel=1, max_queue=1, prefill_chunk=chunk, max_prefixes=0)


def turns(engine, seq, prompts, n=8):
    """Each prompt as a turn of the kept sequence: the greedy replies and their logits."""
    out = []
    for p in prompts:
        req = engine.run(Request(p, n, seq=seq, record_logits=True))
        out.append((req.out, np.stack(req.logits)))
    return out


def assert_same_turns(got, want):
    for (a, la), (c, lc) in zip(got, want):
        assert a == c
        np.testing.assert_allclose(la, lc, atol=1e-5, rtol=1e-5)


def test_chat_runs_a_windowed_pool_and_equals_the_full_one_over_turns(bundles):
    """`edgekv chat`'s batcher (chat_engine, as the terminal opens it) keeps a ring of W - 1 + 64
    slots for the conversation; with rings as tight as W - 1, wrapped by every turn: the full
    pool's replies and logits over four turns (positions to ~90)."""
    from edgekv.runtime.assemble import RING_MARGIN

    b = load_bundle(bundles("float"))
    real = chat_engine(OrtBackend(b, threads=1), b, CONTEXT, chunk=8)
    assert real.cache.local_ring == WINDOW - 1 + RING_MARGIN and real.cache.rings == 1
    # where the ring would not be smaller than the pool it is not taken
    assert chat_engine(OrtBackend(b, threads=1), b, WINDOW - 1 + RING_MARGIN, chunk=8).cache.local_ring is None
    prompts = [ids(14, 30 + t) for t in range(4)]
    full = chat_engine(OrtBackend(b, threads=1), b, CONTEXT, chunk=8, windowed=False)
    assert full.cache.local_ring is None
    want = turns(full, full.hold(), prompts)
    for e in (windowed_chat(b), real):
        seq = e.hold()
        assert_same_turns(turns(e, seq, prompts), want)
        assert seq.pos > 10 * WINDOW and (seq.window_positions() >= 0).all()


def test_a_windowed_turn_rolled_back_leaves_the_ring_as_it_was(bundles):
    """A turn that fails half-way through its reply (after its prompt overwrote the ring) is
    undone: the next turns = those of a conversation that never had it."""
    b = load_bundle(bundles("float"))
    e, ref = windowed_chat(b), windowed_chat(b)
    seq, ref_seq = e.hold(), ref.hold()
    first = ids(20, 40)
    turns(e, seq, [first]), turns(ref, ref_seq, [first])
    before = seq.window_positions().copy()
    with pytest.raises(RuntimeError):
        with e.turn():
            e.run(Request(ids(12, 41), 8, seq=seq))
            assert not np.array_equal(seq.window_positions(), before)
            raise RuntimeError("the turn fails")
    np.testing.assert_array_equal(seq.window_positions(), before)
    rest = [ids(9, 42), ids(11, 43)]
    assert_same_turns(turns(e, seq, rest), turns(ref, ref_seq, rest))


def test_a_windowed_sequence_truncates_within_its_ring_else_it_starts_over(bundles):
    """Truncating to n keeps the ring while it still holds the window before n (the margin);
    past that the batcher says it cannot, and the sequence starts over (as chat's session does):
    either way the next turn = the full pool's after the same truncation."""
    b = load_bundle(bundles("float"))
    prompt, tail = ids(40, 44), ids(6, 45)
    for margin, n, can in ((4, 37, True), (4, 30, False), (0, 39, False)):
        full = chat_engine(OrtBackend(b, threads=1), b, CONTEXT, chunk=8, windowed=False)
        fseq = full.hold()
        full.run(Request(prompt, 1, seq=fseq))
        full.truncate(fseq, n)
        want = turns(full, fseq, [tail])
        e = windowed_chat(b, margin)
        seq = e.hold()
        e.run(Request(prompt, 1, seq=seq))
        assert e.can_truncate(seq, n) is can, (margin, n)
        if can:
            e.truncate(seq, n)
            got = turns(e, seq, [tail])
        else:
            with pytest.raises(ValueError, match="ring no longer holds that window"):
                e.truncate(seq, n)
            e.reset(seq)
            got = turns(e, seq, [prompt[:n] + tail])
        assert_same_turns(got, want)


def test_chat_session_starts_over_where_its_ring_lost_the_window(bundles):
    """ChatSession._keep_common_prefix: a common prefix whose window the ring still holds is
    kept (truncated to), one it lost resets the sequence (re-fed whole by the turn)."""
    from edgekv.chat.session import ChatSession
    from edgekv.runtime.sampling import SamplingParams
    from edgekv.runtime.text import TextCodec

    b = load_bundle(bundles("float"))
    s = ChatSession(b, TextCodec(b), windowed_chat(b, margin=4), SamplingParams(temperature=0.0), None, 4)
    s.batcher.run(Request(ids(30, 46), 1, seq=s.seq))
    held = s.seq.ids
    assert s._keep_common_prefix(held[:28] + [5]) == 28 and s.seq.n == 28
    assert s._keep_common_prefix(held[:10] + [5]) == 0 and s.seq.n == 0


def test_a_windowed_chat_saves_and_loads_its_ring(bundles, tmp_path):
    """A snapshot carries the ring's rows in position order: restored into another windowed pool
    the conversation continues as the saved one does; a full pool's snapshot loads into a
    windowed pool (its last cells fill the ring); a windowed one into a full pool is refused."""
    from edgekv.errors import EdgeKVError

    b = load_bundle(bundles("float"))
    e = windowed_chat(b)
    seq = e.hold()
    turns(e, seq, [ids(25, 47), ids(9, 48)])
    snap, held = e.snapshot(seq), seq.ids
    assert snap["ring.positions"].tolist() == list(range(seq.pos - (WINDOW - 1), seq.pos))
    bad = {**snap, "ring.positions": snap["ring.positions"] + len(held)}  # positions it was never fed
    with pytest.raises(EdgeKVError, match="layout"):  # the ring part is checked before anything changes
        e.check_restore(seq, bad, held)
    nxt = [ids(10, 49), ids(7, 50)]
    want = turns(e, seq, nxt)
    again = windowed_chat(b)
    other = again.hold()
    again.restore(other, snap, held)
    assert_same_turns(turns(again, other, nxt), want)
    full = chat_engine(OrtBackend(b, threads=1), b, CONTEXT, chunk=8, windowed=False)
    fseq = full.hold()
    turns(full, fseq, [ids(25, 47), ids(9, 48)])
    fsnap, fids = full.snapshot(fseq), fseq.ids
    w2 = windowed_chat(b)
    s2 = w2.hold()
    w2.restore(s2, fsnap, fids)
    assert_same_turns(turns(w2, s2, nxt), turns(full, fseq, nxt))
    with pytest.raises(EdgeKVError, match="layout"):
        full.restore(full.hold(), snap, held)
    # chat's own ring (W - 1 + 64) saved, loaded into a ring of W - 1: its last positions
    big = chat_engine(OrtBackend(b, threads=1), b, CONTEXT, chunk=8)
    bseq = big.hold()
    turns(big, bseq, [ids(25, 47), ids(9, 48)])
    bsnap, bids = big.snapshot(bseq), bseq.ids
    assert len(bsnap["ring.positions"]) > WINDOW - 1
    w3 = windowed_chat(b)
    s3 = w3.hold()
    w3.restore(s3, bsnap, bids)
    assert_same_turns(turns(w3, s3, nxt), turns(big, bseq, nxt))


# -- the backends -----------------------------------------------------------------------------

def test_the_trt_backend_feeds_the_local_mask_by_name(bundles, monkeypatch):
    """trt against the TensorRT stand-in (tests/fake_gpu.py: the engine's profiles must cover
    every graph input): bit-identical logits to ort-cpu past the window, alone and serving."""
    from edgekv.runtime.backends import make_backend
    from jetson.build_engine import build_engine
    from tests import fake_gpu

    dst = bundles("int8").parent / "trt-copy"
    if not dst.exists():
        shutil.copytree(bundles("int8"), dst)
    fake_gpu.install(monkeypatch)
    build_engine(str(dst), ctx=64, max_prefill=16)
    b = load_bundle(dst)
    be = make_backend("trt", b, ctx=64, max_logits_rows=16)
    assert be.name == "trt"
    g = Generator(be, KVCache(b, 64, memory=be.memory))
    ref = Generator(OrtBackend(b, threads=1, past_bucket=1, exact=False), KVCache(b, 64), prefill_chunk=16)
    prompt = ids(30, 6)
    got, want = greedy(g, prompt, 12), greedy(ref, prompt, 12)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])
    engine = chat_engine(be, b, 64, chunk=8)
    req = engine.run(Request(prompt, 12, record_logits=True))
    assert req.out == want[0]


def test_fused_attention_takes_sliding_window_layers_when_asked(bundles):
    """The fused rewrite takes the local layers (their own bias from local_key_mask: the fused =
    plain oracles are tests/test_fused_gemma3.py); a float cache still runs as written under auto."""
    from edgekv.runtime.backends.fused import fuse_bundle

    b = load_bundle(bundles("float"))
    assert sum(L.local for L in fuse_bundle(b).layers) == len(b.manifest["model"]["local_layers"])
    assert OrtBackend(b, threads=1, attention="fused").fused is not None
    assert OrtBackend(b, threads=1, attention="auto").fused is None
