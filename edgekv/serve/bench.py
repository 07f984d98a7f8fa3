"""`edgekv bench-serve`: concurrent streaming clients against the server (in-process, or any
OpenAI-compatible --url such as llama_cpp.server), through the chat API, Anthropic's Messages or
OpenAI's Responses API (--api; several: each level through each, taking turns): aggregate and per-client tokens/s, TTFT p50/p95,
peak RSS and KV cells; the TTFT of a second request that shares a long system prompt; RSS over a
soak of short requests. Numbers go to docs/serve.md."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid

import numpy as np

from edgekv.errors import EdgeKVError, note
from edgekv.format.files import write_json
from edgekv.runtime.backends.base import default_threads
from edgekv.runtime.memory import SlotMemory
from edgekv.runtime.cpu import cpu_field, describe

TOPICS = ["a robot that learns to paint", "a train crossing the desert", "a lighthouse keeper", "tea in Kyoto",
          "a city under the sea", "the first moon base", "a lost violin", "a clockmaker's apprentice"]


def rss_mib(pid: int | None = None) -> float:
    import psutil
    return psutil.Process(pid or os.getpid()).memory_info().rss / 2**20


class Sampler:
    """Peak RSS (of `pid`) and peak KV cells used (of an in-process batcher), sampled every 20 ms."""

    def __init__(self, batcher=None, pid=None):
        self.batcher, self.pid = batcher, pid
        self.rss = self.cells = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            self.rss = max(self.rss, rss_mib(self.pid))
            if self.batcher is not None:
                self.cells = max(self.cells, self.batcher.pool.used())
            self._stop.wait(0.02)

    def stop(self):
        self._stop.set()
        self._t.join()


def request_of(api: str, messages: list[dict], max_tokens: int, seed: int, extra: dict | None) -> tuple[str, dict]:
    """(path, body) of one streamed request through `api`: the same conversation and sampling
    through each (seed: an edgekv extension beyond the chat API, so the replies are the same)."""
    common = {"model": "m", "temperature": 0.7, "seed": seed, "stream": True, **(extra or {})}
    if api == "messages":
        system = "".join(m["content"] for m in messages if m["role"] == "system")
        turns = [m for m in messages if m["role"] != "system"]
        return "/v1/messages", {**common, "messages": turns, "max_tokens": max_tokens,
                                **({"system": system} if system else {})}
    if api == "responses":
        return "/v1/responses", {**common, "input": messages, "max_output_tokens": max_tokens}
    return "/v1/chat/completions", {**common, "messages": messages, "max_tokens": max_tokens,
                                    "stream_options": {"include_usage": True}}


def read_event(api: str, ev: dict) -> tuple[bool, int | None, str | None]:
    """(a text piece, the completion tokens, an error) of one streamed event of `api`."""
    if api == "chat":
        if "error" in ev:
            return False, None, str(ev["error"].get("message", ev["error"]))
        ch, usage = ev.get("choices") or [], ev.get("usage") or {}
        return bool(ch and ch[0].get("delta", {}).get("content")), usage.get("completion_tokens"), None
    kind = ev.get("type")
    if kind == "error":
        err = ev.get("error", ev)
        return False, None, str(err.get("message", err))
    if api == "messages":
        text = kind == "content_block_delta" and ev["delta"].get("type") == "text_delta" and bool(ev["delta"]["text"])
        return text, (ev.get("usage") or {}).get("output_tokens") if kind == "message_delta" else None, None
    if kind in ("response.completed", "response.incomplete"):
        return False, (ev["response"].get("usage") or {}).get("output_tokens"), None
    return kind == "response.output_text.delta" and bool(ev.get("delta")), None, None


async def stream_one(h, url: str, messages: list[dict], max_tokens: int, seed: int, extra: dict | None = None,
                     api: str = "chat") -> dict:
    import httpx

    path, body = request_of(api, messages, max_tokens, seed, extra)
    t0 = time.perf_counter()
    t_first, n, usage = None, 0, None
    try:
        async with h.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                raise EdgeKVError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text, tokens, error = read_event(api, json.loads(line[6:]))
                if error is not None:  # the server ended the stream with an error event: a failed request
                    return {"t0": t0, "t_first": t_first, "t1": time.perf_counter(), "tokens": n,
                            "error": f"SSE error: {error[:120]}"}
                usage = tokens or usage
                if text:
                    n += 1
                    t_first = t_first or time.perf_counter()
    except (httpx.HTTPError, json.JSONDecodeError) as e:  # the server broke the stream: a failed request
        return {"t0": t0, "t_first": t_first, "t1": time.perf_counter(), "tokens": n,
                "error": f"{type(e).__name__}: {str(e)[:120]}"}
    t1 = time.perf_counter()
    if usage:
        n = usage  # chunks can hold several tokens (a held-back UTF-8 character)
    return {"t0": t0, "t_first": t_first or t1, "t1": t1, "tokens": n}


async def level(url: str, clients: int, tokens: int, extra: dict | None = None, api: str = "chat") -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600) as h:
        runs = await asyncio.gather(*(stream_one(h, url, [{"role": "user", "content": f"Write a long story about "
                                                          f"{TOPICS[i % len(TOPICS)]}."}], tokens, i, extra, api)
                                      for i in range(clients)))
    failed = [r for r in runs if "error" in r]
    if failed:
        note(f"  {len(failed)} of {clients} streams broke off: {failed[0]['error']}")
    runs = [r for r in runs if "error" not in r]
    if not runs:
        raise EdgeKVError(f"{url}: every stream broke off ({failed[0]['error']})")
    wall = max(r["t1"] for r in runs) - min(r["t0"] for r in runs)
    ttft = [r["t_first"] - r["t0"] for r in runs]
    per = [(r["tokens"] - 1) / (r["t1"] - r["t_first"]) for r in runs if r["tokens"] > 1 and r["t1"] > r["t_first"]]
    return {"clients": clients, "failed": len(failed), "tokens": sum(r["tokens"] for r in runs), "wall_s": wall,
            "aggregate_tps": sum(r["tokens"] for r in runs) / wall, "per_client_tps": float(np.mean(per)) if per else 0.0,
            "ttft_p50_ms": float(np.percentile(ttft, 50)) * 1000, "ttft_p95_ms": float(np.percentile(ttft, 95)) * 1000}


def system_prompt(codec, n_tokens: int) -> str:
    """About n_tokens of varied text, unique to this run (no cache of an earlier run helps)."""
    words = (f"Run {uuid.uuid4().hex[:8]}. You are a careful assistant for a home robot. " +
             " ".join(f"Rule {i}: keep the {TOPICS[i % len(TOPICS)]} notes tidy and answer briefly." for i in range(200)))
    ids = codec.encode(words)[:n_tokens]
    return codec.decode(ids)


SHARED_REPLY = 64  # cells a shared-prefix request needs beyond its system prompt (template, question, 4 tokens)


async def shared_prefix(url: str, system: str, api: str = "chat") -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600) as h:
        out = []
        for q in ("What is rule 3?", "What is rule 7?"):
            r = await stream_one(h, url, [{"role": "system", "content": system}, {"role": "user", "content": q}], 4, 0,
                                 api=api)
            if "error" in r:
                raise EdgeKVError(f"{url}: the stream broke off ({r['error']})")
            out.append((r["t_first"] - r["t0"]) * 1000)
    return {"first_ttft_ms": out[0], "second_ttft_ms": out[1], "speedup": out[0] / out[1]}


async def soak(url: str, n: int, api: str = "chat") -> int:
    """n short streamed requests, 8 at a time; returns how many broke off."""
    import httpx

    failed = 0
    async with httpx.AsyncClient(timeout=600) as h:
        for start in range(0, n, 8):
            runs = await asyncio.gather(*(stream_one(h, url, [{"role": "user", "content": f"Say hi {i}."}], 8, i,
                                                     api=api)
                                          for i in range(start, min(n, start + 8))))
            failed += sum("error" in r for r in runs)
    return failed


class ConstraintLog:
    """Every grammar constraint made while it is open (in this process: the in-process server's),
    for their mask time: GrammarConstraint's __init__, wrapped (whichever thread or helper
    compiles it)."""

    def __init__(self):
        from edgekv.runtime.grammar_constraint import GrammarConstraint

        self.cls, self.made, self.real = GrammarConstraint, [], GrammarConstraint.__init__

    def __enter__(self) -> "ConstraintLog":
        real, made = self.real, self.made

        def init(c, *a, **kw):
            real(c, *a, **kw)
            made.append(c)

        self.cls.__init__ = init
        return self

    def __exit__(self, *exc) -> None:
        self.cls.__init__ = self.real

    def take(self) -> tuple[float, int]:
        """(mask seconds, masks) of the constraints made since the last take."""
        made, self.made[:] = list(self.made), []
        return sum(c.mask_s for c in made), sum(c.masks for c in made)


def structured_levels(url: str, levels: list[int], tokens: int, schema: dict, rounds: int) -> list[dict]:
    """Per level: the same requests with response_format json_schema and free, taking turns
    (the order flips each round); decode tok/s per client of both (medians over the rounds), their
    ratio, the extra decode time per token, and the mask time per constrained token."""
    rf = {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}}
    out = []
    with ConstraintLog() as log:
        for c in levels:
            seen: dict = {"json_schema": [], "free": []}
            mask_s, masks = 0.0, 0
            for rnd in range(rounds):
                for kind in (("json_schema", "free") if rnd % 2 == 0 else ("free", "json_schema")):
                    r = asyncio.run(level(url, c, tokens, rf if kind == "json_schema" else None))
                    seen[kind].append(r)
                    if kind == "json_schema":
                        ms, n = log.take()
                        mask_s, masks = mask_s + ms, masks + n
            tps = {k: float(np.median([r["per_client_tps"] for r in v])) for k, v in seen.items()}
            agg = {k: float(np.median([r["aggregate_tps"] for r in v])) for k, v in seen.items()}
            res = {"clients": c, "rounds": rounds, "per_client_tps": tps, "aggregate_tps": agg,
                   "ratio_json_schema_to_free": tps["json_schema"] / tps["free"] if tps["free"] else 0.0,
                   "extra_ms_per_token": (1 / tps["json_schema"] - 1 / tps["free"]) * 1000
                   if tps["json_schema"] and tps["free"] else None,
                   "mask_us_per_token": mask_s / masks * 1e6 if masks else None,
                   "tokens": {k: sum(r["tokens"] for r in v) for k, v in seen.items()},
                   "failed": sum(r["failed"] for v in seen.values() for r in v)}
            out.append(res)
            note(f"{c} clients: per client json_schema {tps['json_schema']:.1f} tok/s, free {tps['free']:.1f} tok/s "
                 f"(ratio {res['ratio_json_schema_to_free']:.3f}, {res['extra_ms_per_token'] or 0:+.2f} ms/token); "
                 f"mask {res['mask_us_per_token'] or 0:.0f} us per constrained token ({masks} masks)")
    return out


def api_levels(url: str, levels: list[int], tokens: int, apis: list[str], rounds: int) -> list[dict]:
    """Per level: the same requests through each API, taking turns (the order turns each round);
    per-client and aggregate tok/s of each (medians over the rounds) and their largest relative
    spread (one engine underneath: the spread is the machine's noise plus each format's cost)."""
    out = []
    for c in levels:
        seen: dict = {a: [] for a in apis}
        for rnd in range(rounds):
            for a in apis[rnd % len(apis):] + apis[:rnd % len(apis)]:
                seen[a].append(asyncio.run(level(url, c, tokens, api=a)))
        tps = {a: float(np.median([r["per_client_tps"] for r in v])) for a, v in seen.items()}
        agg = {a: float(np.median([r["aggregate_tps"] for r in v])) for a, v in seen.items()}
        ttft = {a: float(np.median([r["ttft_p50_ms"] for r in v])) for a, v in seen.items()}
        spread = (max(tps.values()) - min(tps.values())) / max(tps.values()) if max(tps.values()) else 0.0
        out.append({"clients": c, "rounds": rounds, "per_client_tps": tps, "aggregate_tps": agg, "ttft_p50_ms": ttft,
                    "spread_per_client": spread, "tokens": {a: sum(r["tokens"] for r in v) for a, v in seen.items()},
                    "failed": sum(r["failed"] for v in seen.values() for r in v)})
        note(f"{c} clients: per client " + ", ".join(f"{a} {t:.1f}" for a, t in tps.items()) +
             f" tok/s (spread {spread * 100:.1f} %); aggregate " + ", ".join(f"{a} {t:.1f}" for a, t in agg.items()))
    return out


def cmd_bench_serve(args) -> int:
    from edgekv.serve.listen import BackgroundServer
    from edgekv.serve.server import build, open_serve_runtime, serve_layout

    schema = None
    if args.json_schema:  # read and checked before the model loads, as generate's flag
        from edgekv.runtime.grammar_cli import grammar_from_args

        grammar_from_args(args)
        schema = json.loads(open(args.json_schema, encoding="utf-8").read())

    levels = args.clients  # a list (cli.int_list)
    # serve's own runtime and KV layout (--slots as serve's: auto = fused slots on a static int8 bundle)
    rt = open_serve_runtime(args.bundle, args.ctx, args.backend, args.threads, 0 if args.url else args.slots)
    batcher, srv, pid, layout = None, None, None, None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        layout = serve_layout(rt, args.slots, max(levels), args.ctx)
        note(f"edgekv bench-serve: {layout.why}")
        batcher, app = build(rt, args.ctx, parallel=max(levels), max_queue=4 * max(levels), slots=layout)
        srv = BackgroundServer(app)
        url = srv.url
    kv = kv_of(batcher) if batcher else ""
    threads = None if args.url else args.threads or default_threads()  # --url: the server's own, not known here
    res = {"server": args.url or f"edgekv serve ({rt.backend.name}, {kv})", "cpu": cpu_field(threads), "levels": []}
    note(f"cpu: {describe(threads)}" + (" (this host's; the server at --url may run elsewhere)" if args.url else ""))
    try:
        apis = getattr(args, "api", None) or ["chat"]
        for a in apis:
            asyncio.run(level(url, 1, 8, api=a))  # warm-up
        if schema is not None:
            res["structured"] = structured_levels(url, levels, args.tokens, schema, args.rounds)
            levels = []
        elif len(apis) > 1:
            res["apis"] = api_levels(url, levels, args.tokens, apis, args.rounds)
            return _report(res, args)
        res["api"] = api = apis[0]
        for c in levels:
            s = Sampler(batcher, pid)
            r = asyncio.run(level(url, c, args.tokens, api=api))
            s.stop()
            r.update(peak_rss_mib=s.rss, peak_kv_cells=s.cells if batcher else None)
            res["levels"].append(r)
            note(f"{c} clients: aggregate {r['aggregate_tps']:.1f} tok/s, per client {r['per_client_tps']:.1f} tok/s, "
                 f"TTFT p50 {r['ttft_p50_ms']:.0f} ms p95 {r['ttft_p95_ms']:.0f} ms, {r['tokens']} tokens"
                 + (f" ({r['failed']} streams broke off, left out)" if r["failed"] else "") + ", "
                 f"peak RSS {s.rss:.0f} MiB" + (f", peak KV cells {s.cells:.0f}" if batcher else ""))
        if schema is not None:
            return _report(res, args)
        if layout and layout.slots and args.system_tokens + SHARED_REPLY > layout.capacity // layout.slots:
            note(f"shared {args.system_tokens}-token system prompt: left out (a slot holds "
                 f"{layout.capacity // layout.slots} cells: raise --ctx or lower --system-tokens)")
        else:
            res["shared_prefix"] = p = asyncio.run(shared_prefix(url, system_prompt(rt.codec, args.system_tokens), api))
            note(f"shared {args.system_tokens}-token system prompt: first TTFT {p['first_ttft_ms']:.0f} ms, second "
                 f"{p['second_ttft_ms']:.0f} ms ({p['speedup']:.1f}x)")
        before = rss_mib(pid)
        failed = asyncio.run(soak(url, args.soak, api))
        res["soak"] = {"requests": args.soak, "failed": failed, "rss_before_mib": before, "rss_after_mib": rss_mib(pid)}
        note(f"soak of {args.soak} requests ({failed} broke off): RSS {before:.1f} -> {res['soak']['rss_after_mib']:.1f} MiB")
    finally:
        if srv:
            srv.close()
            batcher.stop()
        rt.close()
    base = res["levels"][0]["aggregate_tps"] if res["levels"] else 0
    for r in res["levels"]:
        r["vs_one_client"] = r["aggregate_tps"] / base if base else 0.0
    return _report(res, args)


def kv_of(batcher) -> str:
    """Where the running server's requests keep their K/V, read off its cache."""
    cache = batcher.cache
    if cache.layout != SlotMemory.layout:  # the cell pool (its memory's slots is 1: any sequence spans it)
        return f"{cache.capacity} cells"
    slots = cache.memory.slots
    return f"{slots} fused slots of {cache.capacity // slots} cells"


def _report(res: dict, args) -> int:
    print(json.dumps(res, indent=1))
    if args.json:
        write_json(args.json, res)  # its folder made, the file atomic (format/files.py)
    return 0
