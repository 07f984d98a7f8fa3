"""Issue 41's grammar storm, against a real `edgekv serve` (not collected by pytest: it times).

    .venv/bin/python -m tests.grammar_storm [BUNDLE] [--clients 16] [--rounds 2] [--port 8765]

Starts `edgekv serve BUNDLE` (default: the quickstart bundle), warms it (a plain and a json_schema
request: the grammar tokenizer is built), takes its RSS, then per round: 16 concurrent json_schema
requests whose string pattern is plain (`^[a-z ]+$`), beside them one plain greedy request,
streamed and timed, and /health polled; then the same with the hostile patterns
(`^(a{1000}){1000}$`, `^([a-z]{1,500}){1,500}$`, `^(.{0,900}x){1,200}$`,
`^((a|b|...|h){1,300}){1,300}$`, 4 each), and with patterns just within the limits (NEAR). The
order flips each round. Prints per round and the medians: the plain request's seconds beside
each storm and their ratio (issue 41: <= 1.5), its time a token after its first (the steps it
shared with the storm, without its wait for a free row), /health's slowest answer (< 0.5 s),
the storm's status codes and tokens, and the server's RSS at the start, its peak and after the
storms (within 10 %). Flags after `--` go to `edgekv serve`."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from edgekv.runtime.memory import kib_field

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "models" / "bundles" / "smollm2-135m-instruct-int8-wint4"
HOSTILE = [r"^(a{1000}){1000}$", r"^([a-z]{1,500}){1,500}$", r"^(.{0,900}x){1,200}$",
           r"^((a|b|c|d|e|f|g|h){1,300}){1,300}$"]
PLAIN = r"^[a-z ]+$"
# within the limits, the costliest kinds for llguidance's lexer: accepted, each row's masks bounded
# (a reply that runs its lexer out of fuel ends alone, with an error)
NEAR = [r"^([a-z]{1,30}){1,30}$", r"^(.{0,100}x){1,100}$", r"^([a-z]{1,120}){1,120}$",
        r"^((a|b|c|d){1,60}){1,60}$"]
ASK = [{"role": "user", "content": "Write a long word made of letters."}]
KINDS = {"plain": [PLAIN], "hostile": HOSTILE, "near": NEAR}
NEIGHBOUR = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
             "max_tokens": 48}


def schema_body(pattern: str, seed: int, max_tokens: int) -> dict:
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"],
              "additionalProperties": False}
    return {"messages": ASK, "temperature": 1.0, "seed": seed, "max_tokens": max_tokens,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def rss_mib(pid: int) -> float:
    rss = kib_field(f"/proc/{pid}/status", "VmRSS")
    return float("nan") if rss is None else rss / 2**20


async def health_poll(client: httpx.AsyncClient, url: str, stop: asyncio.Event) -> float:
    worst = 0.0
    while not stop.is_set():
        t0 = time.perf_counter()
        await client.get(url + "/health")
        worst = max(worst, time.perf_counter() - t0)
        await asyncio.sleep(0.05)
    return worst


async def storm(url: str, patterns: list[str], clients: int, max_tokens: int, pid: int, peak: list) -> dict:
    limits = httpx.Limits(max_connections=clients + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        stop = asyncio.Event()
        health = asyncio.create_task(health_poll(client, url, stop))
        bodies = [schema_body(patterns[i % len(patterns)], i, max_tokens) for i in range(clients)]
        reqs = [asyncio.create_task(client.post(url + "/v1/chat/completions", json=b)) for b in bodies]
        await asyncio.sleep(0.3)  # the storm is in the server before the neighbour comes
        neighbour, per_token = await timed_neighbour(client, url)
        peak[0] = max(peak[0], rss_mib(pid))
        done = await asyncio.gather(*reqs)
        peak[0] = max(peak[0], rss_mib(pid))
        stop.set()
        codes: dict = {}
        tokens = sum(d.json()["usage"]["completion_tokens"] for d in done if d.status_code == 200)
        for d in done:
            key = str(d.status_code) if d.status_code != 200 else "200 " + d.json()["choices"][0]["finish_reason"]
            codes[key] = codes.get(key, 0) + 1
        return {"neighbour_s": neighbour, "per_token_s": per_token, "health_max_s": await health, "codes": codes,
                "tokens": tokens}


async def timed_neighbour(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """The plain request, streamed: (its whole time, its time per token after the first: the
    steps it shared with the storm, without its wait for a free row)."""
    t0, stamps = time.perf_counter(), []
    async with client.stream("POST", url + "/v1/chat/completions", json={**NEIGHBOUR, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    whole = time.perf_counter() - t0
    return whole, (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)


def start(bundle: Path, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "edgekv", "serve", str(bundle), "--port", str(port), "--quiet", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"edgekv serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("edgekv serve did not become ready in 300 s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=str(BUNDLE))
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds after the storms before the last RSS")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more `edgekv serve` flags")
    a = ap.parse_args(argv)
    extra = [x for x in a.serve_args if x != "--"]
    proc = start(Path(a.bundle), a.port, extra)
    url = f"http://127.0.0.1:{a.port}"
    try:
        httpx.post(url + "/v1/chat/completions", json=NEIGHBOUR, timeout=300).raise_for_status()
        httpx.post(url + "/v1/chat/completions", json=schema_body(PLAIN, 0, 16), timeout=300).raise_for_status()
        rss0 = rss_mib(proc.pid)
        peak = [rss0]
        rows: dict = {k: [] for k in KINDS}
        for rnd in range(a.rounds):
            order = ["plain", "hostile", "near"] if rnd % 2 == 0 else ["near", "hostile", "plain"]
            for kind in order:
                res = asyncio.run(storm(url, KINDS[kind], a.clients, a.max_tokens, proc.pid, peak))
                rows[kind].append(res)
                print(f"round {rnd + 1} {kind:7s}: neighbour {res['neighbour_s']:.2f} s "
                      f"({res['per_token_s'] * 1e3:.0f} ms a token after its first), /health max "
                      f"{res['health_max_s']:.3f} s, storm {json.dumps(res['codes'])}, {res['tokens']} tokens",
                      flush=True)
        time.sleep(a.settle)
        rss1 = rss_mib(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    med = {k: statistics.median(r["neighbour_s"] for r in v) for k, v in rows.items()}
    tpot = {k: statistics.median(r["per_token_s"] for r in v) for k, v in rows.items()}
    health = max(r["health_max_s"] for v in rows.values() for r in v)
    load = os.getloadavg()[0]
    print(f"neighbour beside plain {med['plain']:.2f} s, beside hostile {med['hostile']:.2f} s: "
          f"ratio {med['hostile'] / med['plain']:.2f} (<= 1.5); beside near-limit {med['near']:.2f} s: ratio "
          f"{med['near'] / med['plain']:.2f}; per token after the first: plain {tpot['plain'] * 1e3:.0f} ms, hostile "
          f"{tpot['hostile'] * 1e3:.0f} ms, near {tpot['near'] * 1e3:.0f} ms; /health max {health:.3f} s (< 0.5); "
          f"RSS {rss0:.0f} -> peak {peak[0]:.0f} -> {rss1:.0f} MiB after ({(rss1 / rss0 - 1) * 100:+.1f} %, "
          f"within 10 %); load {load:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
