"""`edgekv bench` runs end to end on a tiny bundle and reports every number it promises; its rates
and the stats line's, from a fake clock."""
import json
import types

import numpy as np
import pytest

import edgekv.chat.session as session
import edgekv.runtime.batching.request as request
import edgekv.tools.bench as bench
from edgekv.format.bundle import load_bundle
from edgekv.runtime.assemble import Runtime
from edgekv.runtime.backends.base import UNLIMITED
from edgekv.runtime.memory import HostMemory
from edgekv.runtime.batching import Request
from edgekv.runtime.sampling import SamplingParams
from edgekv.runtime.stats import stats_line, stats_of
from tests.conftest import chat_engine, run_edgekv


def test_bench_reports_all_measurements(tiny_bundle_int8, tmp_path):
    out = tmp_path / "bench.json"
    r = run_edgekv("bench", tiny_bundle_int8, "--prompt-lengths", "8", "--capacities", "32,64", "--fill", "8",
                   "--decode-tokens", "4", "--rss-tokens", "40", "--repeat", "1", "--threads", "1", "--json", out)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert {run["capacity"] for run in d["runs"]} == {32, 64}
    assert all(run["decode_tps"] > 0 and run["ttft_ms"] > 0 for run in d["runs"])
    assert d["decode_ratio_big_vs_small_capacity"] > 0 and 0 < d["fraction_of_bandwidth_bound"]
    assert d["rss"]["tokens"] == 40 and d["peak_rss_mib"] > 0
    assert "of the bound" in r.stdout and "RSS over 40 decoded tokens" in r.stdout
    # progress on stderr while it times (the default bench is minutes before its table): a line per
    # round, and each stage's time when it ends
    err = r.stderr.splitlines()
    rounds = [x for x in err if x.startswith("  round ")]
    assert [x.split(" timed")[0] for x in rounds] == ["  round 1/2 (warm-up)", "  round 2/2"]
    for what in ("timing", "RSS", "read bandwidth"):
        assert any(x.startswith(f"  {what}: done in ") for x in err), (what, r.stderr)


# -- rates from a fake clock: time passes only when the fake backend runs (a prefill call costs
# PREFILL_S, a decode call DECODE_S), so every rate has an exact expected value

PREFILL_S, DECODE_S = 0.25, 0.02
STOP = 2


class Clock:
    def __init__(self):
        self.t = 100.0

    def perf_counter(self) -> float:
        return self.t


class ScriptedBackend:
    """Greedy picks `script` one token per call; each call advances the clock by its cost."""
    memory = HostMemory()
    name, device = "scripted", "cpu"
    max_tokens_per_call, past_bucket = UNLIMITED, 1

    def __init__(self, clock, vocab, script=(), cost=None):
        self.clock, self.vocab, self.script, self.calls = clock, vocab, list(script), 0
        self.cost = cost or (lambda ids, pos: PREFILL_S if ids.shape[1] > 1 else DECODE_S)

    def run_cells(self, cache, past, write, ids, pos, mask, idx):
        self.clock.t += self.cost(ids, pos)
        logits = np.zeros((1, idx.shape[1], self.vocab), np.float32)
        logits[0, :, self.script[self.calls] if self.calls < len(self.script) else 5] = 1.0
        self.calls += 1
        return logits

    def close(self):
        pass


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    for mod in (bench, request, session):  # request: now(), the batcher's only clock
        monkeypatch.setattr(mod, "time", types.SimpleNamespace(perf_counter=c.perf_counter))
    return c


def generate_turn(bundle_path, clock, prompt, max_new, script=()):
    """`edgekv generate`'s turn: one request run by a batcher of its own, its stats taken as
    generate takes them (stats_of)."""
    b = load_bundle(bundle_path)
    batcher = chat_engine(ScriptedBackend(clock, b.model["vocab_size"], script), b, 64)
    seq = batcher.hold()
    req = Request(prompt, max_new, SamplingParams(), {STOP}, seq=seq)
    t0 = request.now()
    batcher.run(req)
    return stats_of(req, t0), req, batcher, seq


def test_generate_rates_exclude_the_first_token(tiny_bundle_float, clock):
    st, req, batcher, seq = generate_turn(tiny_bundle_float, clock, list(range(10, 22)), 5)
    assert len(req.out) == 5 and st.stop_reason == "length"
    # 12 prompt tokens in one 0.25 s call; the first token comes from that call, the other four
    # from four 0.02 s decode calls (the fifth is fed after, outside the rate)
    assert st.ttft_s == pytest.approx(PREFILL_S) and st.prefill_tps == pytest.approx(12 / PREFILL_S)
    assert st.decode_s == pytest.approx(4 * DECODE_S)
    assert st.decode_tps == pytest.approx(1 / DECODE_S)
    line = stats_line(st, batcher.cache, seq)
    assert "TTFT 250 ms" in line and "prefill 12 tok @ 48.0 tok/s" in line and "decode 5 tok @ 50.0 tok/s" in line


def test_decode_rate_when_a_stop_token_ends_the_reply(tiny_bundle_float, clock):
    # prefill -> 7; decode calls -> 8, 9, STOP: three decode calls made three tokens, one of them
    # the stop token (not shown, but the model spent a step on it)
    st, req, _, _ = generate_turn(tiny_bundle_float, clock, list(range(10, 22)), 20, [7, 8, 9, STOP])
    assert req.out == [7, 8, 9] and st.stop_reason == "stop" and st.new_tokens == 3
    assert st.decode_s == pytest.approx(3 * DECODE_S)
    assert st.decode_tps == pytest.approx(1 / DECODE_S)


def chat_session(bundle_path, clock, script=()):
    from edgekv.chat.session import ChatSession
    from edgekv.runtime.text import TextCodec

    b = load_bundle(bundle_path)
    be = ScriptedBackend(clock, b.model["vocab_size"], script)
    return ChatSession(b, TextCodec(b), chat_engine(be, b, 256), SamplingParams(), None, 4)


@pytest.mark.parametrize("script, shown", [([7, 8, 9, STOP], 3), ([], 4)], ids=["stop", "max-tokens"])
def test_chat_turn_rates_from_the_engine(tiny_bundle_float, clock, script, shown):
    """A chat turn on the engine: TTFT is the prefill call; the decode rate counts the calls made
    after the first token that were sampled from (a stop token's step among them), not the
    last token's feed (fed so the cache holds the whole turn)."""
    s = chat_session(tiny_bundle_float, clock, script)
    s.codec.stop_ids = {STOP}
    _, st = s.reply("hello")
    # stop: 7 from the prefill, decode calls -> 8, 9, STOP; max-tokens (4): 5 from the prefill, three decode calls
    assert st.ttft_s == pytest.approx(PREFILL_S) and st.new_tokens == shown and st.decode_steps == 3
    assert st.decode_s == pytest.approx(3 * DECODE_S) and st.decode_tps == pytest.approx(1 / DECODE_S)
    assert s.batcher.backend.calls == 1 + 3 + 1  # the prefill, the decode steps, the last token's feed
    assert s.ids[-1] == (STOP if script else 5)  # the cache holds the whole turn


def test_one_token_has_no_decode_rate(tiny_bundle_float, clock):
    st, req, _, _ = generate_turn(tiny_bundle_float, clock, [10, 11], 1)
    assert len(req.out) == 1
    assert st.decode_tps == 0.0 and st.prefill_tps == pytest.approx(2 / PREFILL_S)


def test_bench_measure_medians_without_the_warmup_round(tiny_bundle_float, clock):
    """Round r runs every configuration at a speed factor F[r]; round 0 is warm-up."""
    F = [50.0, 1.0, 3.0, 2.0]  # the median of rounds 1..3 is 2; with the warm-up it would be 2.5
    configs = [(32, 8), (64, 16)]
    runs = []

    def cost(ids, pos):
        if pos[0, 0] == 0:  # a run starts with its prefill from position 0
            runs.append(ids.shape[1])
        f = F[(len(runs) - 1) // len(configs)]
        return f * (0.01 + 0.001 * ids.shape[1]) if pos[0, 0] == 0 else f * DECODE_S

    b = load_bundle(tiny_bundle_float)
    be = ScriptedBackend(clock, b.model["vocab_size"], cost=cost)
    out = bench.measure(Runtime(b, be, 64), configs, decode_tokens=6, repeat=3)
    assert len(runs) == 4 * len(configs)
    for C, L in configs:
        r = out[(C, L)]
        ttft = 2.0 * (0.01 + 0.001 * L)
        assert r["ttft_ms"] == pytest.approx(1000 * ttft)
        assert r["prefill_tps"] == pytest.approx(L / ttft)
        # six decode calls per run, each making one token: 1 / (2 * DECODE_S) tokens/s
        assert r["decode_tps"] == pytest.approx(1 / (2.0 * DECODE_S))


def test_read_bandwidth_is_bytes_over_seconds(monkeypatch):
    ticks = iter([0.0, 0.004, 1.0, 1.002, 2.0, 2.008])  # three reads: 4, 2 and 8 ms
    from edgekv.tools import host

    monkeypatch.setattr(host, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    nbytes = 1 << 20
    assert host.read_bandwidth(2, nbytes, repeat=3) == pytest.approx(nbytes / 0.002)  # the best read


@pytest.mark.parametrize("kind", ["steady", "bursty"])
def test_a_neighbour_runs_for_the_block_and_is_gone_after(kind):
    """--neighbour's processes (one; bursty: one a core) use the CPU while the bench runs and are
    killed and reaped when it ends."""
    import os
    import time

    from edgekv.tools.host import neighbour

    with neighbour(kind) as procs:
        time.sleep(1.0)
        assert len(procs) == (1 if kind == "steady" else os.cpu_count())
        for p in procs:
            assert p.poll() is None
            with open(f"/proc/{p.pid}/stat") as f:
                busy = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])  # utime + stime, ticks
            assert busy > 0
    assert all(p.returncode is not None for p in procs)  # reaped
    for p in procs:
        assert not os.path.exists(f"/proc/{p.pid}") or "Z" not in open(f"/proc/{p.pid}/stat").read().split()[2]
    with neighbour("none") as nothing:
        assert nothing == []
