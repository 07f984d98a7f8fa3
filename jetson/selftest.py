"""The Jetson self-test: does edgekv work on this board, and how fast? One command, one report.

    bash jetson/selftest.sh BUNDLE [BUNDLE...] [--ctx 1024] [--report FILE] [--skip-bench]

1. versions: JetPack/L4T, TensorRT, CUDA, onnxruntime providers, cuda-python, free memory
2. for each BUNDLE (exported on the workstation, best with --dtype float16, copied here; give
   the float-weights one and the --weights int4 one to test TensorRT's INT4 weights too):
   builds (or reuses) its TensorRT engine, then steps 3 and 4
3. runs the same prompt through ort-cpu (the reference), ort-cuda (if onnxruntime-gpu is
   installed) and trt: ✓/✗ per backend with the max |logit diff| (fed the same tokens) against
   the tolerance the exporter measured for this bundle, and whether free-running greedy tokens
   are equal
3b. on a float16 int8-static bundle, ort-cuda's fused graph (EDGEKV_ATTENTION=fused, docs/fused.md
   "ort-cuda"): every GroupQueryAttention node ran on CUDA (read from onnxruntime's profile of a
   prefill and a decode step), and its 32 greedy tokens against the graph as written on ort-cuda
4. `edgekv serve`'s engine on trt: four chat prompts joining a batch give the greedy tokens each
   gives alone on trt, and the aggregate decode rate of four sequences against one
5. the benchmark on the fastest backend (time to first token, decode tokens/s, peak memory), with
   power and RAM from tegrastats when present
6. writes one JSON report (and prints a summary); exit status 0 only if every check that must
   pass on a Jetson passed (trt required; ort-cuda optional)."""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from edgekv.errors import BackendUnavailable, EdgeKVError
from edgekv.format.bundle import load_bundle
from edgekv.runtime.assemble import Runtime, open_runtime
from edgekv.runtime.backends.ort_cuda import OrtCudaBackend
from edgekv.runtime.text import TextCodec

PROMPT = "What is the capital of France? Answer in one sentence."
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello in German."]


def say(msg: str) -> None:
    print(msg, flush=True)


def parse_tegrastats(line: str) -> dict:
    """RAM used (MiB) and board input power (mW) from one tegrastats line, where present."""
    out = {}
    m = re.search(r"RAM (\d+)/(\d+)MB", line)
    if m:
        out["ram_used_mib"], out["ram_total_mib"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"(?:VDD_IN|VIN_SYS_5V0|POM_5V_IN) (\d+)mW", line)
    if m:
        out["power_mw"] = int(m.group(1))
    return out


class Tegrastats:
    """Samples tegrastats in the background (Jetson only; absent elsewhere)."""

    def __init__(self, interval_ms: int = 500):
        self.samples: list[dict] = []
        exe = shutil.which("tegrastats")
        self.proc = subprocess.Popen([exe, "--interval", str(interval_ms)], stdout=subprocess.PIPE, text=True) if exe else None
        if self.proc:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            s = parse_tegrastats(line)
            if s:
                self.samples.append(s)

    def stop(self) -> dict:
        if not self.proc:
            return {"tegrastats": "not found (not a Jetson)"}
        self.proc.terminate()
        self.proc.wait(timeout=5)
        p = [s["power_mw"] for s in self.samples if "power_mw" in s]
        r = [s["ram_used_mib"] for s in self.samples if "ram_used_mib" in s]
        return {"samples": len(self.samples), "power_mw_mean": float(np.mean(p)) if p else None,
                "power_mw_max": max(p) if p else None, "ram_used_mib_max": max(r) if r else None}


def greedy_run(rt: Runtime, prompt: list[int], steps: int, feed: list[int] | None = None):
    """Logits of the prefill and `steps` decode steps; fed `feed` tokens if given (so two backends
    see the same inputs), else its own greedy tokens."""
    g = rt.stream()
    logits = [g.prefill(prompt).copy()]
    tokens = []
    for i in range(steps):
        tok = int(np.argmax(logits[-1])) if feed is None else feed[i]
        tokens.append(int(np.argmax(logits[-1])))
        logits.append(g.decode_step(tok).copy())
    return np.stack(logits), tokens


def compare_backends(bundle, ctx: int, steps: int = 32) -> tuple[list[dict], bool]:
    codec = TextCodec(bundle)
    prompt = codec.chat_ids([{"role": "user", "content": PROMPT}])
    steps = min(steps, ctx - len(prompt) - 1)
    if steps < 1:
        raise EdgeKVError(f"--ctx {ctx} is too small for the {len(prompt)}-token test prompt")
    tol = bundle.logits_tolerance()
    with open_runtime(bundle, ctx, "ort-cpu") as ref:
        ref_logits, ref_tokens = greedy_run(ref, prompt, steps)
    say(f"  reference ort-cpu: \"{codec.decode(ref_tokens)[:60]}...\"")
    rows, ok = [], True
    for name, required in (("ort-cuda", False), ("trt", True)):
        try:
            rt = open_runtime(bundle, ctx, name, log=None)
        except BackendUnavailable as e:
            rows.append({"backend": name, "status": "unavailable", "why": str(e)})
            say(f"  {'✗' if required else '-'} {name:<9} unavailable: {e}")
            ok &= not required
            continue
        with rt:
            fed, _ = greedy_run(rt, prompt, steps, feed=ref_tokens)
            _, own = greedy_run(rt, prompt, steps)
        diff = float(np.abs(fed - ref_logits).max())
        same = sum(a == b for a, b in zip(own, ref_tokens))
        first = next((i for i, (a, b) in enumerate(zip(own, ref_tokens)) if a != b), None)
        # TensorRT gets a bundle's 8-bit weights per output channel (engines.tensorrt_graph), not
        # the blocks ort-cpu runs: on top of the exporter's tolerance, that requantization's share
        # (the stand-in test measures < 2 % of the logits' range on a tiny model)
        t = tol + (0.02 * float(np.abs(ref_logits).max()) if name == "trt" and bundle.weights != "float" else 0.0)
        # a divergence is acceptable only at a near-tie of the reference's own logits
        tie = first is not None and ref_logits[first][ref_tokens[first]] - ref_logits[first][own[first]] <= t
        good = diff <= t and (first is None or tie)
        ok &= good
        rows.append({"backend": name, "status": "pass" if good else "fail", "max_abs_logit_diff": diff, "tol": t,
                     "greedy_identical": same, "greedy_steps": steps, "first_divergence": first})
        say(f"  {'✓' if good else '✗'} {name:<9} max|diff| = {diff:.3g} (tol {t:.3g}); greedy {same}/{steps} identical"
            + (f" (first differs at step {first}{', a near-tie' if tie else ''})" if first is not None else ""))
    return rows, ok


CUDA = "CUDAExecutionProvider"


def gqa_placement(events: list) -> dict[str, str]:
    """GroupQueryAttention node -> the provider that ran it, from onnxruntime's profile JSON.
    onnxruntime gives a node its CUDA kernels refuse to the CPU without a word, and
    session.get_providers() still lists CUDA first: only the profile says where each node ran."""
    out = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("cat") == "Node" and args.get("op_name") == "GroupQueryAttention" and e["name"].endswith("_kernel_time"):
            out[e["name"][: -len("_kernel_time")]] = args.get("provider", "?")
    return out


def fused_check(bundle, ctx: int, workdir: Path, steps: int = 32, backend_cls=OrtCudaBackend,
                provider: str = CUDA) -> tuple[dict, bool]:
    """ort-cuda's fused graph on a float16 int8-static bundle: each GroupQueryAttention on
    `provider` (a profiled prefill and decode step), then `steps` greedy tokens against the graph
    as written on the same backend (equal, or a first divergence at a near-tie of the plain
    graph's logits), and the fused logits fed the plain tokens. ort-cuda missing: skipped."""
    if bundle.dtype != "float16" or bundle.scheme.kind != "static":
        return {"status": "skipped", "why": f"a {bundle.dtype} {bundle.scheme.name} bundle (the check takes a "
                                            f"float16 int8-static one)"}, True
    codec = TextCodec(bundle)
    prompt = codec.chat_ids([{"role": "user", "content": PROMPT}])
    steps = min(steps, ctx - len(prompt) - 1)

    class Profiled(backend_cls):
        profile_prefix = str(workdir / "edgekv-fused-profile")

    try:
        be = Profiled(bundle, attention="fused")
    except BackendUnavailable as e:
        if not str(e).startswith("fused attention"):  # no onnxruntime-gpu or no GPU: ort-cuda is optional here
            return {"status": "unavailable", "why": str(e)}, True
        return {"status": "fail", "why": str(e)}, False  # ort-cuda runs, its fused graph does not
    try:
        with Runtime(bundle, be, ctx) as rt:
            g = rt.stream()
            g.decode_step(int(np.argmax(g.prefill(prompt))))
            placed = gqa_placement(json.loads(Path(be.session.end_profiling()).read_text()))
        with Runtime(bundle, backend_cls(bundle, attention="plain"), ctx) as rt:
            plain_logits, plain = greedy_run(rt, prompt, steps)
        with Runtime(bundle, backend_cls(bundle, attention="fused"), ctx) as rt:
            fed, _ = greedy_run(rt, prompt, steps, feed=plain)
            _, fused = greedy_run(rt, prompt, steps)
    except Exception as e:  # CUDA's kernel refusing an input at run time: the report says which
        return {"status": "fail", "why": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}, False
    off = sorted(n for n, p in placed.items() if p != provider)
    tol = bundle.logits_tolerance()
    first = next((i for i, (a, b) in enumerate(zip(fused, plain)) if a != b), None)
    tie = first is not None and plain_logits[first][plain[first]] - plain_logits[first][fused[first]] <= tol
    good = len(placed) == bundle.model["n_layers"] and not off and (first is None or tie)
    res = {"status": "pass" if good else "fail", "attention": be.attention, "gqa_nodes": len(placed),
           "layers": bundle.model["n_layers"], "gqa_not_on_" + provider: off,
           "greedy_identical": sum(a == b for a, b in zip(fused, plain)), "greedy_steps": steps,
           "first_divergence": first, "max_abs_logit_diff_fed": float(np.abs(fed - plain_logits).max())}
    say(f"  {'✓' if good else '✗'} fused on {be.name}: {len(placed) - len(off)}/{bundle.model['n_layers']} "
        f"GroupQueryAttention on {provider.replace('ExecutionProvider', '')}"
        + (f" (elsewhere: {', '.join(off)})" if off else "")
        + f"; greedy {res['greedy_identical']}/{steps} identical to the graph as written"
        + (f" (first differs at step {first}{', a near-tie' if tie else ''})" if first is not None else "")
        + f"; max|diff| fed the same tokens {res['max_abs_logit_diff_fed']:.3g}")
    return res, good


def decode_rate(batcher, reqs) -> float:
    """Aggregate decode tokens/s of `reqs` run together, from the step at which every one has its
    first token (its prompt prefilled) to the last."""
    for r in reqs:
        batcher.submit(r)
    t1 = n1 = None
    while not all(r.finish_reason for r in reqs):
        batcher.step()
        if t1 is None and all(r.ttft_s is not None for r in reqs):
            t1, n1 = time.perf_counter(), sum(len(r.out) for r in reqs)
    dt = time.perf_counter() - t1
    return (sum(len(r.out) for r in reqs) - n1) / dt if dt > 0 else 0.0


def serve_check(bundle, ctx: int, backend: str = "trt") -> tuple[dict, bool]:
    """`edgekv serve`'s batcher on `backend`: four chat prompts joining a batch two steps apart give
    the greedy tokens each gives alone on the same backend (a divergence only at a near-tie of the
    lone run's logits); then the aggregate decode rate of four sequences against one."""
    from edgekv.runtime.batching import Request

    codec = TextCodec(bundle)
    prompts = [codec.chat_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    new = min(32, ctx // len(prompts) - max(map(len, prompts)) - 1)
    if new < 4:
        return {"backend": backend, "status": "skipped", "why": f"--ctx {ctx} leaves no room for 4 prompts"}, True
    tol = bundle.logits_tolerance()
    with open_runtime(bundle, ctx, backend, log=None) as rt:
        alone = [greedy_run(rt, p, new) for p in prompts]
        batcher = rt.batcher(capacity=ctx, parallel=len(prompts))
        reqs = [Request(p, new) for p in prompts]
        for r in reqs:  # each joins two steps after the previous one, mid-prefill or mid-decode of the others
            batcher.submit(r)
            batcher.step(), batcher.step()
        while not all(r.finish_reason for r in reqs):
            batcher.step()
        rows, ok = [], True
        for r, (logits, want) in zip(reqs, alone):
            first = next((i for i, (a, b) in enumerate(zip(r.out, want)) if a != b), None)
            tie = first is not None and logits[first][want[first]] - logits[first][r.out[first]] <= tol
            ok &= first is None or tie
            rows.append({"identical": sum(a == b for a, b in zip(r.out, want)), "steps": new, "first_divergence": first})
        n = 64 if ctx >= len(prompts) * (max(map(len, prompts)) + 65) else new
        one = decode_rate(batcher, [Request(prompts[0], n)])
        four = decode_rate(batcher, [Request(p, n) for p in prompts])
        moved, secs = batcher.counters["moved_cells"], batcher.counters["compaction_seconds"]
    res = {"backend": backend, "status": "pass" if ok else "fail", "sequences": rows, "decode_tps_1": one,
           "decode_tps_4": four, "ratio_4_vs_1": four / one if one > 0 else None,
           "compaction_moved_cells": moved, "compaction_ms": secs * 1e3}
    say(f"  {'✓' if ok else '✗'} serve on {backend}: 4 joining sequences = alone "
        f"({sum(r['identical'] for r in rows)}/{len(rows) * new} greedy tokens identical); aggregate decode "
        f"{four:.1f} tok/s with 4 vs {one:.1f} with 1 ({res['ratio_4_vs_1'] or 0:.2f}x); compaction moved "
        f"{moved} cells in {secs * 1e3:.1f} ms")
    return res, ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="jetson/selftest.sh", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("bundle", nargs="+", help="bundle folder(s) exported on the workstation (best: --dtype float16; "
                                              "add the --weights int4 one for TensorRT's INT4 weights)")
    ap.add_argument("--ctx", type=int, default=1024, help="KV capacity for the engine, the checks and the bench")
    ap.add_argument("--report", default="edgekv-selftest.json", help="report file")
    ap.add_argument("--skip-bench", action="store_true", help="only versions, engine and parity")
    args = ap.parse_args(argv)
    from jetson.env_check import report

    rep = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "bundles": []}
    ok = True
    try:
        say("== versions")
        rep["env"] = env = report()
        for k in ("l4t", "tensorrt", "cuda", "onnxruntime", "onnxruntime_providers", "mem_available_mib"):
            say(f"  {k:<22} {env.get(k)}")
        for i, path in enumerate(args.bundle):
            one = {"bundle": path}
            rep["bundles"].append(one)
            try:
                ok &= check_bundle(path, args, one, Path(args.report).with_suffix(f".bench{i}.json"))
            except EdgeKVError as e:  # this bundle fails; the others are still checked
                say(f"  ✗ {path}: {e}")
                one["error"], ok = str(e), False
        rep["passed"] = ok
    except EdgeKVError as e:
        say(f"selftest: error: {e}")
        rep["passed"], rep["error"] = False, str(e)
    Path(args.report).write_text(json.dumps(rep, indent=1, default=str))
    say(f"== {'PASS' if rep['passed'] else 'FAIL'}; report: {args.report}")
    return 0 if rep["passed"] else 1


def check_bundle(path: str, args, rep: dict, bench_json: Path) -> bool:
    """Engine, parity and (unless --skip-bench) the benchmark of one bundle, into `rep`; True if
    everything that must pass did."""
    bundle = load_bundle(path)
    ctx = min(args.ctx, bundle.max_context)
    say(f"== {bundle.path.name}: kv {bundle.scheme.name}, weights {bundle.weights}, {bundle.dtype}")
    rep["weights"] = bundle.weights
    say("  TensorRT engine")
    ok = True
    try:
        from jetson.build_engine import build_engine
        rep["engine"] = str(build_engine(path, ctx))
    except EdgeKVError as e:
        rep["engine"] = f"failed: {e}"
        say(f"  ✗ {e}")
        ok = False

    say("  backends against ort-cpu (same prompt, fed the same tokens; tolerance from the bundle's export)")
    rep["parity"], parity_ok = compare_backends(bundle, ctx)
    ok &= parity_ok
    say("  ort-cuda's fused graph (EDGEKV_ATTENTION=fused; float16 int8-static bundles)")
    rep["fused"], fused_ok = fused_check(bundle, ctx, Path(args.report).resolve().parent)
    if rep["fused"]["status"] in ("skipped", "unavailable"):
        say(f"  - fused: {rep['fused']['status']}: {rep['fused']['why']}")
    ok &= fused_ok
    if any(r["backend"] == "trt" and r["status"] == "pass" for r in rep["parity"]):
        say("  serving engine on trt (edgekv serve)")
        rep["serve"], serve_ok = serve_check(bundle, ctx, "trt")
        ok &= serve_ok

    if not args.skip_bench:
        say("  benchmark")
        best = next((r["backend"] for r in reversed(rep["parity"]) if r["status"] == "pass"), "ort-cpu")
        ts = Tegrastats()
        cmd = [sys.executable, "-m", "edgekv", "bench", path, "--backend", best, "--capacities", str(ctx),
               "--prompt-lengths", f"64,{min(512, ctx - 80)}", "--fill", "64", "--rss-tokens", "200",
               "--json", str(bench_json)]
        p = subprocess.run(cmd, text=True)
        rep["power"] = ts.stop()
        if p.returncode == 0:
            rep["bench"] = json.loads(bench_json.read_text())
        else:
            rep["bench"] = "failed"
            ok = False
        say(f"  power/RAM: {rep['power']}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
