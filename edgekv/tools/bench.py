"""`edgekv bench`: time to first token, decode tokens/s, memory. Medians over --repeat runs;
comparisons are ratios within one run (these machines are shared and noisy)."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from edgekv.errors import note
from edgekv.format.files import write_text
from edgekv.format.bundle import load_bundle
from edgekv.runtime.assemble import Runtime, open_runtime
from edgekv.runtime.backends import default_threads
from edgekv.runtime.generate import Generator


def rss_bytes() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process, from /proc (no psutil needed on the device)."""
    cur = peak = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return cur, peak


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeat: int = 5) -> float:
    """Bytes/s for a streaming read of a buffer far larger than cache, split over `threads`
    threads (numpy's reductions release the GIL). The yardstick for bandwidth-bound decode."""
    a = np.ones(nbytes // 4, np.float32)
    parts = np.array_split(a, threads)
    best = 0.0
    for _ in range(repeat):
        ths = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        best = max(best, a.nbytes / (time.perf_counter() - t0))
    del a, parts
    return best


def sample_tokens(n: int, vocab: int) -> list[int]:
    """A fixed pseudo-text of n token ids (speed does not depend on which tokens)."""
    return [int(x) for x in np.random.default_rng(0).integers(100, min(vocab, 30000), n)]


def time_once(g: Generator, prompt: list[int], decode_tokens: int) -> tuple[float, float]:
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
    """Time every (capacity, prompt length) configuration `repeat` times, round-robin: each
    round runs every configuration once, so a slow spell of a shared machine hits all of them
    alike instead of whichever was measured first. One backend (one session) serves all."""
    caches = {C: rt.cache(C) for C in sorted({c for c, _ in configs})}
    gens = {key: rt.generator(prefill_chunk=512, cache=caches[key[0]]) for key in configs}
    prompts = {key: sample_tokens(key[1], rt.bundle.model["vocab_size"]) for key in configs}
    times = {key: ([], []) for key in configs}
    for r in range(repeat + 1):  # round 0 warms up the backend's allocations and is dropped
        for key in configs:
            ttft, tps = time_once(gens[key], prompts[key], decode_tokens)
            if r:
                times[key][0].append(ttft)
                times[key][1].append(tps)
    out = {}
    for (C, L), (ttft, tps) in times.items():
        out[(C, L)] = {"capacity": C, "prompt_tokens": L, "decode_tokens": decode_tokens,
                       "ttft_ms": 1000 * statistics.median(ttft), "prefill_tps": L / statistics.median(ttft),
                       "decode_tps": statistics.median(tps)}
    return out


def rss_over_decode(rt: Runtime, n_tokens: int):
    g = rt.generator(min(rt.bundle.max_context, n_tokens + 80))
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


def cmd_bench(args) -> int:
    bundle = load_bundle(args.bundle)
    threads = args.threads or default_threads()
    caps, lens, fills = args.capacities, args.prompt_lengths, args.fill  # lists (cli.int_list)
    big = max(caps)
    res = {"bundle": str(bundle.path), "kv_scheme": bundle.scheme.name, "threads": threads,
           "kv_bytes_per_token": bundle.kv_bytes_per_token(), "runs": []}
    note(f"edgekv bench: {bundle.path.name} (kv {bundle.scheme.name}, {threads} threads, median of {args.repeat})")

    plan = []  # (what, capacity, prompt length)
    for L in lens:  # time to first token by prompt length
        plan.append(("prompt", big if L + args.decode_tokens > min(caps) else min(caps), L))
    for F in fills:  # decode speed by context fill, and by capacity at the smallest fill
        for C in caps:
            if F + args.decode_tokens <= C and (F == min(fills) or C == big):
                plan.append(("fill", C, F))
    configs = list(dict.fromkeys((C, L) for _, C, L in plan))
    with open_runtime(bundle, big, args.backend, threads) as rt:
        return bench(args, rt, res, configs, caps, fills, threads)


def bench(args, rt: Runtime, res: dict, configs: list, caps: list[int], fills: list[int], threads: int) -> int:
    bundle, big = rt.bundle, max(caps)
    res["backend"] = rt.backend.name
    note(f"  {len(configs)} configurations x {args.repeat + 1} rounds (round-robin; the first round is warm-up) "
        f"on {rt.backend.name} ...")
    seen = measure(rt, configs, args.decode_tokens, args.repeat)
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
    note(f"  RSS over {args.rss_tokens} decoded tokens ...")
    res["rss"] = rss_over_decode(rt, args.rss_tokens)
    # peak before the bandwidth probe: its 1 GiB array is not the model's memory
    res["peak_rss_mib"] = rss_bytes()[1] / 2**20
    note("  read bandwidth ...")
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
        note("  transformers (eager) on the same weights ...")
        cmd = [sys.executable, "-m", "export.bench_transformers", args.transformers, "--threads", str(threads),
               "--prompt-tokens", str(small_fill), "--decode-tokens", str(args.decode_tokens), "--repeat", str(args.repeat)]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
        if p.returncode != 0:
            note(f"  transformers run failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
        else:
            hf = json.loads(p.stdout.strip().splitlines()[-1])
            res["transformers"] = hf
            res["decode_ratio_vs_transformers"] = best / hf["transformers_decode_tps"]
            print(f"transformers eager decode at fill {small_fill}: {hf['transformers_decode_tps']:.2f} tok/s -> "
                  f"edgekv is {res['decode_ratio_vs_transformers']:.2f}x")
    r = res["rss"]
    print(f"RSS over {r['tokens']} decoded tokens: {r['rss_start_mib']:.1f} -> {r['rss_end_mib']:.1f} MiB "
          f"({r['rss_growth_mib']:+.2f} MiB); peak RSS {res['peak_rss_mib']:.0f} MiB")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_text(args.json, json.dumps(res, indent=1))
        note(f"  wrote {args.json}")
    return 0
