"""A bounded soak of `edgekv serve` on loopback (issue 41 item 8; docs/fleet.md has a run's result).

    python tests/soak.py BUNDLE --minutes 30 [--workers 3] [--restart-every 5] [--logs DIR]

For --minutes, `--workers` clients send every request kind the server answers, chosen at random:
chat and completions (whole and streamed), json_schema, tools, logprobs, and /v1/messages and
/v1/responses where a probe at each start finds them (a 404 skips them), each reply checked
(a json_schema reply that stopped must parse and match its schema, a tool call name its tool,
logprobs one entry per token, a stream end in a finish and [DONE]). Among them the client faults:
a stream dropped after two chunks, a slow client (headers and part of a body, then nothing: the
server's --read-timeout must answer 408 or close), a body that is not JSON (400), a body over
--max-body (413). Every --restart-every minutes the lifecycle: the clients paused until the server
is idle, then /health's cells (no cell may stay held by a sequence: "cells back") and the RSS
read, the clients resumed with a 400-token stream beside them, SIGTERM (a drain of --drain-seconds
with requests running: their 503s and cut streams are expected, a stream that just stops is not),
and the server started again, first on a damaged copy of the bundle (a truncated weight file, a garbled
manifest, a truncated tokenizer, bytes flipped in the weights at the same size, in turn), which
must be refused at start in one line (the flipped one, which loading does not hash by design
(README: `edgekv verify`), must be refused by `edgekv verify` in one line). Also each cycle:
`edgekv chat` whose /save goes to a 256 KiB tmpfs (mounted here as root; skipped with a note
where mount is not permitted) must say so in one line and leave no temporary file.

The last line is the summary: requests, errors by kind (expected vs unexpected), RSS start/end,
KV cells back. Exit 1 if anything unexpected happened (DIR/unexpected.jsonl has each)."""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from edgekv.runtime.memory import kib_field

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string", "maxLength": 16}},
                                                          "required": ["city"], "additionalProperties": False}}}]
TOPICS = ["the sea", "a red bicycle", "prime numbers", "a lighthouse keeper", "bread", "the moon", "a lost key",
          "autumn", "trains", "a cat named Ada"]


def rss_mib(pid: int) -> float | None:
    rss = kib_field(f"/proc/{pid}/status", "VmRSS")  # None once the process is gone
    return None if rss is None else rss / 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Tally:
    """Every request's kind and outcome; the unexpected ones also to DIR/unexpected.jsonl."""

    def __init__(self, logdir: Path):
        self.lock = threading.Lock()
        self.requests = collections.Counter()
        self.ok = collections.Counter()
        self.expected = collections.Counter()
        self.unexpected = collections.Counter()
        self.notes: list[str] = []
        self.file = open(logdir / "unexpected.jsonl", "w")

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        """outcome: ok | expected:WHY | unexpected:WHY"""
        with self.lock:
            self.requests[kind] += 1
            if outcome == "ok":
                self.ok[kind] += 1
            elif outcome.startswith("expected:"):
                self.expected[f"{kind}/{outcome[9:]}"] += 1
            else:
                self.unexpected[f"{kind}/{outcome.split(':', 1)[-1]}"] += 1
                self.file.write(json.dumps({"t": time.strftime("%H:%M:%S"), "kind": kind, "outcome": outcome,
                                            "detail": detail[:2000]}) + "\n")
                self.file.flush()
                print(f"soak: UNEXPECTED {kind} {outcome}: {detail[:300]}", flush=True)

    def event(self, kind: str, outcome: str, detail: str = "") -> None:
        """A lifecycle event (not a request): counted apart from the requests."""
        self.add(f"@{kind}", outcome, detail)


class Server:
    def __init__(self, bundle: Path, port: int, logdir: Path, flags: list[str]):
        self.bundle, self.port, self.logdir, self.flags = bundle, port, logdir, flags
        self.proc: subprocess.Popen | None = None
        self.lives = 0
        self.out = self.err = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, bundle: Path | None = None) -> subprocess.Popen:
        self.lives += 1
        self.out = self.logdir / f"serve.{self.lives}.out"
        self.err = self.logdir / f"serve.{self.lives}.err"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "edgekv", "serve", str(bundle or self.bundle), "--host", HOST,
                                      "--port", str(self.port), *self.flags],
                                     stdout=open(self.out, "w"), stderr=open(self.err, "w"), env=env, cwd=ROOT)
        return self.proc

    def wait_ready(self, timeout: float = 300) -> bool:
        """True once /health is 200; False if the process exited first."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                return False
            try:
                if httpx.get(self.url + "/health", timeout=3).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"serve not ready in {timeout} s ({self.err})")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def sigterm(self, timeout: float = 120) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


class Soak:
    def __init__(self, args):
        self.args = args
        self.logdir: Path = args.logs
        self.tally = Tally(self.logdir)
        self.rng = random.Random(args.seed)
        self.deadline = time.monotonic() + args.minutes * 60
        self.flags = ["--threads", str(args.threads), "--parallel", "4", "--read-timeout", str(args.read_timeout),
                      "--drain-seconds", str(args.drain_seconds), "--max-body", str(args.max_body)]
        self.server = Server(args.bundle, args.port or free_port(), self.logdir, self.flags)
        self.go = threading.Event()  # clear: the clients wait (the lifecycle's idle reading)
        self.go.set()
        self.busy = collections.Counter()  # requests in flight per worker
        self.window = threading.Lock()
        self.lifecycle = False  # a SIGTERM / restart in progress: refusals and cuts are expected
        self.generation = 0  # bumped at each start and end of a lifecycle window
        self.endpoints = {"messages": False, "responses": False}
        self.lives: list[dict] = []  # per server life: rss at ready, rss at its last idle reading, cells
        self.cells: list[dict] = []
        self.damage_kinds = ["truncated weights", "garbled manifest", "truncated tokenizer", "flipped weight bytes"]
        self.cycle = 0
        self.mount: Path | None = None
        self.mount_note = ""

    # -- helpers
    def in_window(self, gen0: int) -> bool:
        with self.window:
            return self.lifecycle or self.generation != gen0

    def set_window(self, on: bool) -> None:
        with self.window:
            self.lifecycle = on
            self.generation += 1

    def probe(self) -> None:
        for name, path, body in (("messages", "/v1/messages", {"model": "m", "max_tokens": 2,
                                                                 "messages": [{"role": "user", "content": "hi"}]}),
                                 ("responses", "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 2})):
            try:
                r = httpx.post(self.server.url + path, json=body, timeout=60)
                self.endpoints[name] = r.status_code != 404
            except httpx.HTTPError:
                self.endpoints[name] = False

    def kinds(self) -> list[tuple[str, float]]:
        k = [("chat", 3), ("chat_stream", 3), ("completion", 2), ("completion_stream", 2), ("json_schema", 2),
             ("json_schema_stream", 2), ("tools", 2), ("tools_stream", 2), ("logprobs", 1.5), ("logprobs_stream", 1),
             ("fault_disconnect", 1), ("fault_slow_body", 0.4), ("fault_slow_headers", 0.2), ("fault_bad_json", 1),
             ("fault_oversized", 0.5)]
        if self.endpoints["messages"]:
            k += [("messages", 1.5), ("messages_stream", 1.5)]
        if self.endpoints["responses"]:
            k += [("responses", 1.5), ("responses_stream", 1.5)]
        return k

    # -- the clients
    def worker(self, w: int) -> None:
        rng = random.Random(self.args.seed * 1000 + w)
        with httpx.Client(timeout=httpx.Timeout(180, connect=10)) as client:
            while time.monotonic() < self.deadline:
                self.go.wait()
                if time.monotonic() >= self.deadline:
                    return
                kinds = self.kinds()
                kind = rng.choices([k for k, _ in kinds], [x for _, x in kinds])[0]
                with self.window:
                    gen0 = self.generation
                self.busy[w] += 1
                try:
                    outcome, detail = self.one(client, kind, rng)
                except Exception as e:  # the soak's own bug, or a transport error classify did not expect
                    outcome, detail = "unexpected:client_exception", f"{type(e).__name__}: {e}"
                finally:
                    self.busy[w] -= 1
                if outcome.startswith("unexpected:") and self.in_window(gen0) and not outcome.endswith(
                        ("schema_violation", "bad_reply", "stream_cut_silently", "server_5xx")):
                    outcome = "expected:" + outcome.split(":", 1)[1] + "_during_restart"
                    time.sleep(0.5)  # the server is stopping or starting: no busy loop against a closed port
                self.tally.add(kind, outcome, detail)

    def one(self, client: httpx.Client, kind: str, rng: random.Random) -> tuple[str, str]:
        base = self.server.url
        topic = rng.choice(TOPICS)
        n = rng.choice([8, 16, 32, 48])
        try:
            if kind.startswith("fault_"):
                return getattr(self, kind)(client, rng)
            stream = kind.endswith("_stream")
            k = kind.removesuffix("_stream")
            if k == "completion":
                body = {"prompt": f"A short note about {topic}:", "max_tokens": n, "temperature": 0.8, "stream": stream}
                return self.call(client, base + "/v1/completions", body, k, stream)
            if k == "messages":
                body = {"model": "m", "max_tokens": n, "stream": stream,
                        "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}
                return self.call(client, base + "/v1/messages", body, k, stream)
            if k == "responses":
                body = {"model": "m", "input": f"Tell me about {topic}.", "max_output_tokens": n, "stream": stream}
                return self.call(client, base + "/v1/responses", body, k, stream)
            body = {"messages": [{"role": "user", "content": f"Tell me about {topic}."}], "max_tokens": n,
                    "temperature": rng.choice([0, 0.7, 1.0]), "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            if k == "json_schema":
                body["messages"][0]["content"] = f"Invent a person who loves {topic}, as JSON."
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA,
                                                                                  "strict": True}}
                body["max_tokens"] = 64
            elif k == "tools":
                body["messages"][0]["content"] = f"What is the weather where {topic} is?"
                body["tools"] = TOOLS
                body["tool_choice"] = rng.choice(["required", "auto"])
                body["max_tokens"] = 48
            elif k == "logprobs":
                body["logprobs"] = True
                body["top_logprobs"] = 2
            return self.call(client, base + "/v1/chat/completions", body, k, stream)
        except (httpx.ConnectError, ConnectionRefusedError) as e:
            return "unexpected:connect_error", str(e)
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            return "unexpected:connection_dropped", f"{type(e).__name__}: {e}"
        except httpx.TimeoutException as e:
            return "unexpected:timeout", f"{type(e).__name__}: {e}"

    def refusal(self, r: httpx.Response, text: str) -> tuple[str, str]:
        try:
            err = json.loads(text).get("error")
        except ValueError:
            err = None
        if not isinstance(err, dict) or not err.get("message"):
            return f"unexpected:not_openai_error_{r.status_code}", text[:500]
        if r.status_code == 503 and r.headers.get("retry-after"):
            return "unexpected:503", text[:300]  # expected only in a lifecycle window (worker() decides)
        if r.status_code == 429:
            return "expected:429_queue_full", text[:300]
        if r.status_code >= 500:
            return "unexpected:server_5xx", f"{r.status_code} {text[:500]}"
        return f"unexpected:http_{r.status_code}", text[:500]

    def call(self, client, url, body, k, stream) -> tuple[str, str]:
        if not stream:
            r = client.post(url, json=body)
            if r.status_code != 200:
                return self.refusal(r, r.text)
            return self.check_whole(k, body, r.json())
        with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return self.refusal(r, r.read().decode(errors="replace"))
            events, done, error, named = [], False, None, []
            for line in r.iter_lines():
                if line.startswith("event: "):
                    named.append(line[7:])
                if not line.startswith("data: "):
                    continue
                if line[6:] == "[DONE]":
                    done = True
                    continue
                ev = json.loads(line[6:])
                if isinstance(ev, dict) and "error" in ev and k not in ("messages", "responses"):
                    error = ev["error"]
                    continue
                if isinstance(ev, dict) and ev.get("type") in ("error", "response.failed"):
                    error = ev
                    continue
                events.append(ev)
        if error is not None:
            code = (error.get("code") or error.get("error", {}).get("type") or "") if isinstance(error, dict) else ""
            if "shutting_down" in json.dumps(error):
                return "expected:stream_cut_by_drain_with_error_event", str(error)[:300]
            return "unexpected:stream_error_event", f"{code} {str(error)[:500]}"
        return self.check_stream(k, body, events, done, named)

    def check_whole(self, k, body, data) -> tuple[str, str]:
        try:
            if k == "messages":
                ok = isinstance(data.get("content"), list) and data.get("stop_reason")
                return ("ok", "") if ok else ("unexpected:bad_reply", json.dumps(data)[:500])
            if k == "responses":
                ok = isinstance(data.get("output"), list) and data.get("status") in ("completed", "incomplete")
                return ("ok", "") if ok else ("unexpected:bad_reply", json.dumps(data)[:500])
            ch = data["choices"][0]
            fin = ch.get("finish_reason")
            if fin not in ("stop", "length", "tool_calls"):
                return "unexpected:bad_finish", json.dumps(data)[:500]
            if "usage" not in data:
                return "unexpected:no_usage", json.dumps(data)[:500]
            if k == "completion":
                return ("ok", "") if isinstance(ch.get("text"), str) else ("unexpected:bad_reply", json.dumps(data)[:500])
            msg = ch["message"]
            return self.check_message(k, body, msg, fin, ch.get("logprobs"), data["usage"])
        except (KeyError, IndexError, TypeError) as e:
            return "unexpected:bad_reply", f"{e!r} {json.dumps(data)[:500]}"

    def check_message(self, k, body, msg, fin, logprobs, usage) -> tuple[str, str]:
        if k == "tools":
            calls = msg.get("tool_calls") or []
            if body["tool_choice"] == "required" and not calls:
                return "unexpected:no_tool_call", json.dumps(msg)[:500]
            for c in calls:
                if c["function"]["name"] != "get_weather":
                    return "unexpected:bad_tool_name", json.dumps(c)[:500]
                if fin in ("stop", "tool_calls"):
                    try:
                        args = json.loads(c["function"]["arguments"])
                    except ValueError:
                        return "unexpected:schema_violation", c["function"]["arguments"][:500]
                    if not isinstance(args.get("city"), str):
                        return "unexpected:schema_violation", json.dumps(args)[:500]
            return "ok", ""
        if not isinstance(msg.get("content"), str):
            return "unexpected:bad_reply", json.dumps(msg)[:500]
        if k == "json_schema" and fin == "stop":
            import jsonschema

            try:
                jsonschema.validate(json.loads(msg["content"]), SCHEMA)
            except (ValueError, jsonschema.ValidationError) as e:
                return "unexpected:schema_violation", f"{str(e)[:200]} {msg['content'][:300]!r}"
        if k == "logprobs":
            content = (logprobs or {}).get("content")
            if not isinstance(content, list) or len(content) != usage["completion_tokens"]:
                return "unexpected:bad_logprobs", f"{len(content or [])} entries for {usage['completion_tokens']} tokens"
            if any(len(e.get("top_logprobs", [])) != 2 or e["logprob"] > 0 for e in content):
                return "unexpected:bad_logprobs", json.dumps(content[:3])[:500]
        return "ok", ""

    def check_stream(self, k, body, events, done, named) -> tuple[str, str]:
        if k == "messages":
            types = [e.get("type") for e in events]
            return ("ok", "") if "message_stop" in types else ("unexpected:stream_cut_silently", str(types[-5:]))
        if k == "responses":
            types = [e.get("type") for e in events]
            ended = {"response.completed", "response.incomplete"} & set(types)  # incomplete: max_output_tokens
            return ("ok", "") if ended else ("unexpected:stream_cut_silently", str(types[-5:]))
        fin, text, calls, lps, usage = None, "", {}, [], None
        for ev in events:
            usage = ev.get("usage") or usage
            for ch in ev.get("choices") or []:
                fin = ch.get("finish_reason") or fin
                if k == "completion":
                    text += ch.get("text") or ""
                    continue
                d = ch.get("delta") or {}
                text += d.get("content") or ""
                for tc in d.get("tool_calls") or []:
                    slot = calls.setdefault(tc.get("index", 0), {"function": {"name": None, "arguments": ""}})
                    f = tc.get("function") or {}
                    slot["function"]["name"] = slot["function"]["name"] or f.get("name")
                    slot["function"]["arguments"] += f.get("arguments") or ""
                lps += ((ch.get("logprobs") or {}).get("content") or [])
        if fin is None or not done:
            return "unexpected:stream_cut_silently", f"finish={fin} done={done} {len(events)} events"
        if k == "completion":
            return "ok", ""
        if body.get("stream_options", {}).get("include_usage") and usage is None:
            return "unexpected:no_usage", f"{len(events)} events"
        msg = {"content": text, "tool_calls": list(calls.values())}
        return self.check_message(k, body, msg, fin, {"content": lps}, usage or {"completion_tokens": len(lps)})

    # -- client faults
    def fault_disconnect(self, client, rng) -> tuple[str, str]:
        body = {"messages": [{"role": "user", "content": "Write a long story about the sea."}], "max_tokens": 200,
                "stream": True}
        with client.stream("POST", self.server.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return self.refusal(r, r.read().decode(errors="replace"))
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got >= 2:
                        break
        return "ok", ""  # closed under the reply; the cells' return is checked at the next idle reading

    def raw(self, data: bytes, pause_after: bytes = b"", wait: float = 0.0, drip: bytes = b"") -> bytes:
        """Send `data`, then `drip` one byte a second, then wait for the answer (at most
        read_timeout + 10 s): the server's bytes ('' if it closed without any)."""
        with socket.create_connection((HOST, self.server.port), timeout=self.args.read_timeout + 10) as s:
            s.sendall(data)
            t0 = time.monotonic()
            try:
                for b in drip:
                    if time.monotonic() - t0 > self.args.read_timeout + 5:
                        break
                    s.sendall(bytes([b]))
                    time.sleep(1.0)
            except OSError:
                pass  # the server closed it: what we want
            out = b""
            try:
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    out += chunk
                    if b"\r\n\r\n" in out and (b"content-length" in out.lower()):
                        head, _, rest = out.partition(b"\r\n\r\n")
                        n = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0].split(b":")[1])
                        if len(rest) >= n:
                            break
            except (socket.timeout, ConnectionResetError):
                pass
            return out

    def fault_slow_body(self, client, rng) -> tuple[str, str]:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{self.server.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        t0 = time.monotonic()
        out = self.raw(head + body[:10])
        took = time.monotonic() - t0
        status = out.split(b" ", 2)[1] if out.startswith(b"HTTP/1.1 ") else b""
        if status == b"408" or (not out and took < self.args.read_timeout + 9):
            return "expected:408_read_timeout", f"{status!r} after {took:.1f} s"
        if status == b"503":
            return "unexpected:503", out[:300].decode(errors="replace")
        return "unexpected:slow_body_not_timed_out", f"{out[:300]!r} after {took:.1f} s"

    def fault_slow_headers(self, client, rng) -> tuple[str, str]:
        t0 = time.monotonic()
        out = self.raw(b"POST /v1/chat/completions HTTP/1.1\r\n", drip=b"X-Slow: " + b"a" * 64)
        took = time.monotonic() - t0
        status = out.split(b" ", 2)[1] if out.startswith(b"HTTP/1.1 ") else b""
        if status == b"408" or (not out and took < self.args.read_timeout + 9):
            return "expected:408_read_timeout", f"{status!r} after {took:.1f} s"
        return "unexpected:slow_headers_not_timed_out", f"{out[:300]!r} after {took:.1f} s"

    def fault_bad_json(self, client, rng) -> tuple[str, str]:
        bad = rng.choice([b"{", b"{\"messages\": [", b"\xff\xfe{}", b"[]", b"{\"messages\": \"x\"}", b"null",
                          b"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":\"many\"}"])
        r = client.post(self.server.url + "/v1/chat/completions", content=bad,
                        headers={"content-type": "application/json"})
        if r.status_code == 400 and "error" in r.json():
            return "expected:400_bad_json", ""
        return self.refusal(r, r.text) if r.status_code != 200 else ("unexpected:bad_json_accepted", r.text[:300])

    def fault_oversized(self, client, rng) -> tuple[str, str]:
        big = json.dumps({"messages": [{"role": "user", "content": "x" * (self.args.max_body + 1000)}]}).encode()
        try:
            r = client.post(self.server.url + "/v1/chat/completions", content=big,
                            headers={"content-type": "application/json"})
        except (httpx.RemoteProtocolError, httpx.WriteError, httpx.ReadError) as e:
            return "unexpected:oversized_connection_dropped", f"{type(e).__name__}: {e}"
        if r.status_code == 413:
            return "expected:413_body_too_large", ""
        return self.refusal(r, r.text) if r.status_code != 200 else ("unexpected:oversized_accepted", "")

    # -- the lifecycle
    def idle_reading(self) -> dict:
        """Pause the clients, wait until the server runs nothing, read its cells and RSS."""
        self.go.clear()
        t0 = time.monotonic()
        while sum(self.busy.values()) and time.monotonic() - t0 < 240:
            time.sleep(0.2)
        h = {}
        for _ in range(50):
            h = self.server.health()
            if not h.get("active") and not h.get("waiting"):
                break
            time.sleep(0.2)
        held = h["cells_used"] - h["cells_cached_only"]
        reading = {"life": self.server.lives, "rss_mib": rss_mib(self.server.proc.pid), "cells_used": h["cells_used"],
                   "cells_cached_only": h["cells_cached_only"], "held_by_sequences": held, "active": h.get("active"),
                   "requests": h.get("requests"), "t": round(self.args.minutes * 60 - (self.deadline - time.monotonic()))}
        self.cells.append(reading)
        self.tally.event("cells_back", "ok" if held == 0 and not h.get("active") else "unexpected:cells_held",
                         json.dumps(reading))
        return reading

    def start_good(self) -> None:
        self.server.start()
        if not self.server.wait_ready():
            raise RuntimeError(f"the good bundle did not start: {self.server.err.read_text()[-2000:]}")
        self.probe()
        self.lives.append({"life": self.server.lives, "rss_ready_mib": rss_mib(self.server.proc.pid)})

    def damaged_copy(self, kind: str) -> Path:
        d = Path(tempfile.mkdtemp(prefix="soak-damaged-", dir=self.logdir))
        shutil.rmtree(d)
        shutil.copytree(self.args.bundle, d)
        man = json.loads((d / "edgekv.json").read_text())
        data = [n for n in man["files"]["sizes"] if n.endswith(".data")] or [man["files"]["onnx"]]
        if kind == "truncated weights":
            f = d / data[0]
            os.truncate(f, f.stat().st_size // 2)
        elif kind == "garbled manifest":
            raw = bytearray((d / "edgekv.json").read_bytes())
            raw[len(raw) // 3: len(raw) // 3 + 8] = b"\x00{{]]:,\""
            (d / "edgekv.json").write_bytes(bytes(raw))
        elif kind == "truncated tokenizer":
            os.truncate(d / man["files"]["tokenizer"], 1000)
        elif kind == "flipped weight bytes":
            f = d / data[0]
            with open(f, "r+b") as fh:
                fh.seek(f.stat().st_size // 2)
                b = fh.read(4096)
                fh.seek(f.stat().st_size // 2)
                fh.write(bytes(x ^ 0xFF for x in b))
        return d

    def one_line_error(self, text: str, prefix: str) -> bool:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in text

    def damaged(self) -> None:
        kind = self.damage_kinds[(self.cycle - 1) % len(self.damage_kinds)]
        d = self.damaged_copy(kind)
        try:
            p = self.server.start(d)
            ready = self.server.wait_ready()
            err = self.server.err.read_text()
            if kind == "flipped weight bytes":
                # loading checks the manifest and the sizes, not the hashes (README: edgekv verify)
                if ready:
                    self.server.sigterm()
                    self.tally.event("damaged_bundle", "expected:flipped_bytes_served_sizes_only_checked", kind)
                else:
                    self.tally.event("damaged_bundle", "ok" if self.one_line_error(err, "edgekv serve: error:")
                                     else "unexpected:refusal_not_one_line", err[-1500:])
                env = dict(os.environ, PYTHONPATH=str(ROOT))
                v = subprocess.run([sys.executable, "-m", "edgekv", "verify", str(d)], capture_output=True, text=True,
                                   env=env, cwd=ROOT, timeout=300)
                ok = v.returncode != 0 and self.one_line_error(v.stderr, "edgekv verify: error:") and "sha256" in v.stderr
                self.tally.event("verify_damaged", "ok" if ok else "unexpected:verify_not_one_line",
                                 f"rc={v.returncode} {v.stderr[-1000:]}")
                return
            if ready:
                self.server.sigterm()
                self.tally.event("damaged_bundle", "unexpected:damaged_bundle_served", kind)
                return
            rc = p.wait()
            one = self.one_line_error(err, "edgekv serve: error:")
            self.tally.event("damaged_bundle", "ok" if rc != 0 and one else "unexpected:refusal_not_one_line",
                             f"{kind}: rc={rc} {err[-1500:]}")
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def restart(self) -> None:
        reading = self.idle_reading()
        self.lives[-1]["rss_idle_mib"] = reading["rss_mib"]
        self.lives[-1]["requests"] = reading["requests"]
        self.go.set()
        long = threading.Thread(target=self.long_stream, daemon=True)  # longer than the drain: it must be cut cleanly
        long.start()
        time.sleep(2.5)  # requests in flight for the drain
        self.set_window(True)
        try:
            rc = self.server.sigterm()
            long.join(60)
            err = self.server.err.read_text()
            self.tally.event("sigterm", "ok" if rc == 0 else f"unexpected:exit_{rc}", err[-800:])
            if "Traceback" in err:
                self.tally.event("server_log", "unexpected:traceback", err[-3000:])
            self.damaged()
            self.start_good()
        finally:
            self.set_window(False)

    def long_stream(self) -> None:
        """A 400-token stream running at the SIGTERM: it finishes within the drain, or is cut with an
        SSE error event and [DONE] (docs/serve.md "Stopping: the drain"), never just stops."""
        body = {"messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}],
                "max_tokens": 400, "temperature": 0.8, "stream": True}
        try:
            with httpx.Client(timeout=httpx.Timeout(120, connect=10)) as c:
                outcome, detail = self.call(c, self.server.url + "/v1/chat/completions", body, "chat", True)
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            outcome, detail = "unexpected:connection_dropped", f"{type(e).__name__}: {e}"
        except Exception as e:
            outcome, detail = "unexpected:client_exception", f"{type(e).__name__}: {e}"
        if outcome == "ok":
            outcome = "expected:finished_within_drain"
        self.tally.event("stream_at_sigterm", outcome, detail)

    def chat_full_disk(self) -> None:
        if self.mount is None:
            return
        name = self.mount / f"chat{self.cycle}.npz"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        r = subprocess.run([sys.executable, "-m", "edgekv", "chat", str(self.args.bundle), "--max-new-tokens", "8",
                            "--threads", "1", "--ctx", "512"],
                           input=f"Hello there.\n/save {name}\n", capture_output=True, text=True, env=env, cwd=ROOT,
                           timeout=300)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        left = [p.name for p in self.mount.iterdir()]
        ok = (r.returncode == 0 and len(errors) == 1 and "no space left" in errors[0].lower() and str(name) in errors[0]
              and "Traceback" not in r.stderr and not left)
        self.tally.event("chat_save_full_disk", "ok" if ok else "unexpected:chat_save_full_disk",
                         f"rc={r.returncode} left={left} {r.stderr[-1500:]}")

    def mount_tmpfs(self) -> None:
        d = self.logdir / "full-disk"
        d.mkdir(exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            self.mount_note = f"chat /save on a full disk skipped: mount not permitted ({r.stderr.strip()[:200]})"
            print("soak:", self.mount_note, flush=True)
            return
        self.mount = d  # 256 KiB: a saved chat of one short exchange is ~500 KB on the quickstart model

    def unmount(self) -> None:
        if self.mount is not None:
            subprocess.run(["umount", str(self.mount)], capture_output=True)

    def run(self) -> int:
        load0 = os.getloadavg()
        self.mount_tmpfs()
        self.start_good()
        print(f"soak: serve on {self.server.url}, endpoints {self.endpoints}, {self.args.workers} clients, "
              f"{self.args.minutes} min", flush=True)
        threads = [threading.Thread(target=self.worker, args=(w,), daemon=True) for w in range(self.args.workers)]
        for t in threads:
            t.start()
        every = self.args.restart_every * 60
        next_cycle = time.monotonic() + every
        loads = [load0]
        try:
            while time.monotonic() < self.deadline:
                time.sleep(min(5.0, max(0.0, self.deadline - time.monotonic())))
                loads.append(os.getloadavg())
                if time.monotonic() >= next_cycle and self.deadline - time.monotonic() > 60:
                    self.cycle += 1
                    print(f"soak: cycle {self.cycle} at {time.strftime('%H:%M:%S')}: {sum(self.tally.requests.values())} "
                          f"requests, unexpected {dict(self.tally.unexpected)}", flush=True)
                    self.chat_full_disk()
                    self.restart()
                    next_cycle = time.monotonic() + every
            for t in threads:
                t.join(300)
            final = self.idle_reading()
            self.lives[-1]["rss_idle_mib"] = final["rss_mib"]
            self.lives[-1]["requests"] = final["requests"]
            self.go.set()
            self.set_window(True)
            rc = self.server.sigterm()
            err = self.server.err.read_text()
            self.tally.event("sigterm", "ok" if rc == 0 else f"unexpected:exit_{rc}", err[-800:])
            for i in range(1, self.server.lives + 1):
                e = (self.logdir / f"serve.{i}.err")
                if e.exists() and "Traceback" in e.read_text():
                    self.tally.event("server_log", "unexpected:traceback", f"serve.{i}.err")
        finally:
            if self.server.proc and self.server.proc.poll() is None:
                self.server.proc.kill()
            self.unmount()
        return self.summary(loads)

    def summary(self, loads) -> int:
        t = self.tally
        reqs = {k: v for k, v in t.requests.items() if not k.startswith("@")}
        events = {k: v for k, v in t.requests.items() if k.startswith("@")}
        first, last = self.lives[0], self.lives[-1]
        held = [c["held_by_sequences"] for c in self.cells]
        longest = max(self.lives, key=lambda x: x.get("requests") or 0)
        result = {"minutes": self.args.minutes, "requests": sum(reqs.values()), "by_kind": reqs,
                  "ok": sum(v for k, v in t.ok.items() if not k.startswith("@")),
                  "expected": dict(t.expected), "unexpected": dict(t.unexpected), "events": events,
                  "server_lives": self.lives, "idle_readings": self.cells, "endpoints": self.endpoints,
                  "load_avg_1min_min_max": [min(x[0] for x in loads), max(x[0] for x in loads)],
                  "load_avg_start_end": [loads[0], os.getloadavg()], "mount_note": self.mount_note}
        (self.logdir / "summary.json").write_text(json.dumps(result, indent=1))
        exp = sum(v for k, v in t.expected.items() if not k.startswith("@"))
        unexp = sum(t.unexpected.values())
        by = lambda c: ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"  # noqa: E731
        good = lambda k: t.ok[k] + sum(v for e, v in t.expected.items() if e.startswith(k + "/"))  # noqa: E731
        life = "; ".join(f"{k[1:]} {good(k)}/{v} as expected" for k, v in sorted(events.items()))
        print(f"soak: {self.args.minutes:g} min, {result['requests']} requests ({result['ok']} ok, {exp} expected errors, "
              f"{unexp} unexpected); expected: {by(t.expected)}; unexpected: {by(t.unexpected)}; "
              f"server lives {self.server.lives} ({len(self.lives)} on the good bundle); lifecycle: {life}; "
              f"RSS start {first['rss_ready_mib']:.0f} MiB end {last.get('rss_idle_mib') or 0:.0f} MiB "
              f"(busiest life {longest['life']}: {longest['rss_ready_mib']:.0f} -> {longest.get('rss_idle_mib') or 0:.0f} MiB "
              f"over {longest.get('requests')} requests); KV cells back: {'yes' if held and not any(held) else 'NO'} "
              f"(held by sequences at {len(held)} idle readings: {held}); "
              f"load avg {result['load_avg_1min_min_max'][0]:.1f}-{result['load_avg_1min_min_max'][1]:.1f}"
              + (f"; {self.mount_note}" if self.mount_note else ""), flush=True)
        return 1 if unexp else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path)
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--restart-every", type=float, default=5, help="minutes between SIGTERM/restart cycles")
    p.add_argument("--threads", type=int, default=1, help="serve's --threads")
    p.add_argument("--read-timeout", type=float, default=4.0, help="serve's --read-timeout (the slow clients wait it)")
    p.add_argument("--drain-seconds", type=float, default=3.0)
    p.add_argument("--max-body", type=int, default=1 << 20)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", type=Path, default=None, help="folder for the servers' logs and the summary")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.minutes > 24 * 60:
        p.error("--minutes: 0 < minutes <= 1440")
    args.bundle = args.bundle.resolve()
    args.logs = (args.logs or Path(tempfile.mkdtemp(prefix="edgekv-soak-"))).resolve()
    args.logs.mkdir(parents=True, exist_ok=True)
    print(f"soak: logs in {args.logs}", flush=True)
    return Soak(args).run()


if __name__ == "__main__":
    sys.exit(main())
