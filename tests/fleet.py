"""A fleet on loopback for tests/test_fleet.py (issue 41 item 7): `edgekv serve` boards behind a
LiteLLM proxy configured by docs/fleet.md's YAML, a client that retries what it is told it may
retry, and the record of every attempt (which board LiteLLM sent it to, how it ended).

Also runnable by hand, for the times in docs/fleet.md:
    python tests/fleet.py BUNDLE [--litellm PATH] [--report out.json]
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MASTER_KEY = "sk-edgekv-fleet-test-0123456789abcdef"  # LiteLLM's own key (the proxy refuses to start without one)
BOARD_KEY = "edgekv-fleet-board-key"


def litellm_path() -> str | None:
    """The `litellm` proxy's command: $EDGEKV_LITELLM, else on PATH, else beside this Python. LiteLLM
    is best in a venv of its own (docs/fleet.md: litellm[proxy] pins huggingface-hub < 2, which the
    test extra's transformers 5 cannot import); the proxy is a process of its own anyway."""
    found = os.environ.get("EDGEKV_LITELLM") or shutil.which("litellm")
    if not found:
        beside = Path(sys.executable).with_name("litellm")
        found = str(beside) if beside.exists() else None
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def doc_config(ports: list[int], routing: str | None = None) -> str:
    """docs/fleet.md's LiteLLM YAML (the first ```yaml block under "## LiteLLM"), its board-N:8080
    turned into this machine's loopback ports: the test runs what the document tells users."""
    text = (ROOT / "docs" / "fleet.md").read_text()
    section = text[text.index("## LiteLLM"):]
    m = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert m, "docs/fleet.md: no ```yaml block under ## LiteLLM"
    yaml = m.group(1)
    for i, port in enumerate(ports, 1):
        assert f"board-{i}:8080" in yaml, f"docs/fleet.md's YAML names no board-{i}:8080"
        yaml = yaml.replace(f"board-{i}:8080", f"127.0.0.1:{port}")
    routing = routing or os.environ.get("EDGEKV_FLEET_ROUTING")
    if routing:  # a comparison (--routing, $EDGEKV_FLEET_ROUTING): the document's strategy replaced
        yaml, n = re.subn(r"routing_strategy: \S+", f"routing_strategy: {routing}", yaml)
        assert n == 1
    return yaml


def wait_http(url: str, ok, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> float:
    """Poll `url` until `ok(response)`; the seconds it took. Fails if `proc` exits first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited {proc.returncode} before it was ready")
        try:
            if ok(httpx.get(url, timeout=2)):
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what}: {url} not ready in {timeout:.0f} s")


class Board:
    """One `edgekv serve` on a fixed loopback port (a restart keeps the port LiteLLM knows)."""

    def __init__(self, bundle: Path, port: int, keyfile: Path, logdir: Path, name: str, threads: int = 1):
        self.bundle, self.port, self.keyfile, self.logdir, self.name, self.threads = bundle, port, keyfile, logdir, name, threads
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        self.starts += 1
        log = open(self.logdir / f"{self.name}.{self.starts}.log", "w")
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(self.threads))
        self.proc = subprocess.Popen([sys.executable, "-m", "edgekv", "serve", str(self.bundle), "--port", str(self.port),
                                      "--threads", str(self.threads), "--api-key-file", str(self.keyfile)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_ready(self, timeout: float = 300) -> float:
        return wait_http(f"http://127.0.0.1:{self.port}/health", lambda r: r.status_code == 200, timeout, self.proc,
                         f"board {self.name}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Proxy:
    def __init__(self, exe: str, config: str, port: int, logdir: Path, board_key: str = BOARD_KEY):
        self.port = port
        (logdir / "litellm.yaml").write_text(config)
        env = dict(os.environ, EDGEKV_KEY=board_key, LITELLM_MASTER_KEY=MASTER_KEY,
                   LITELLM_LOCAL_MODEL_COST_MAP="True",  # no download of the price list at start
                   LITELLM_TELEMETRY="False", LITELLM_LOG="INFO", NO_PROXY="*", no_proxy="*")
        self.log = logdir / "litellm.log"
        self.proc = subprocess.Popen([exe, "--config", str(logdir / "litellm.yaml"), "--host", "127.0.0.1", "--port",
                                      str(port), "--num_workers", "1"],
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env, cwd=logdir)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300) -> float:
        return wait_http(self.url + "/health/liveliness", lambda r: r.status_code == 200, timeout, self.proc, "litellm")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- the requests
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string", "maxLength": 12}},
                                                          "required": ["city"], "additionalProperties": False}}}]


def request_body(i: int, max_tokens: int = 24) -> dict:
    """The i-th of the mix: plain, json_schema, tools (each streamed or not), a completion-style
    question; streamed every other one."""
    kind = ("plain", "json_schema", "tools", "plain")[i % 4]
    stream = (i // 4) % 2 == 1 if kind != "plain" else i % 2 == 1
    body = {"model": "smollm2", "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": stream,
            "messages": [{"role": "user", "content": f"Request {i}: tell me about the number {i}."}]}
    if kind == "json_schema":
        body["messages"][0]["content"] = f"Invent a person number {i}: name and age, as JSON."
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
        body["max_tokens"] = 48
    elif kind == "tools":
        body["messages"][0]["content"] = f"What is the weather in city number {i}?"
        body["tools"] = TOOLS
        body["tool_choice"] = "required"
        body["max_tokens"] = 48
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Attempt:
    i: int
    n: int  # 0: first try; 1, 2...: the client's retries
    start: float
    end: float = 0.0
    status: int = 0
    board: str | None = None  # x-litellm-model-api-base: the board that answered
    retries: int | None = None  # x-litellm-attempted-retries: LiteLLM's own retries for it
    outcome: str = ""  # ok | clean (an error the client may retry) | unclean
    detail: str = ""


def kind_of(body: dict) -> str:
    return "json_schema" if "response_format" in body else "tools" if "tools" in body else "plain"


def check_message(body: dict, message: dict) -> str:
    """'' if `message` is a valid answer to `body`, else why not."""
    kind = kind_of(body)
    if kind == "tools":
        calls = message.get("tool_calls") or []
        if not calls:
            return f"no tool_calls: {message!r:.200}"
        for c in calls:
            if c.get("function", {}).get("name") != "get_weather" or not isinstance(c["function"].get("arguments"), str):
                return f"bad tool call {c!r:.200}"
        return ""
    if not isinstance(message.get("content"), str):
        return f"no content: {message!r:.200}"
    return ""


def one_attempt(client: httpx.Client, url: str, body: dict, a: Attempt) -> None:
    headers = {"Authorization": f"Bearer {MASTER_KEY}"}
    try:
        if not body["stream"]:
            r = client.post(url, json=body, headers=headers)
            a.status, a.board = r.status_code, r.headers.get("x-litellm-model-api-base")
            a.retries = int(r.headers.get("x-litellm-attempted-retries", -1))
            try:
                data = r.json()
            except ValueError:
                a.outcome, a.detail = "unclean", f"{r.status_code} not JSON: {r.text[:200]!r}"
                return
            if r.status_code == 200:
                choice = data["choices"][0]
                why = check_message(body, choice["message"])
                if why or choice.get("finish_reason") not in ("stop", "length", "tool_calls"):
                    a.outcome, a.detail = "unclean", why or f"finish_reason {choice.get('finish_reason')!r}"
                else:
                    a.outcome = "ok"
            elif r.status_code >= 500 or r.status_code == 429:
                ok = isinstance(data.get("error"), dict) and data["error"].get("message")
                a.outcome, a.detail = ("clean" if ok else "unclean"), f"{r.status_code}: {str(data)[:300]}"
            else:
                a.outcome, a.detail = "unclean", f"{r.status_code}: {str(data)[:300]}"
            return
        with client.stream("POST", url, json=body, headers=headers) as r:
            a.status, a.board = r.status_code, r.headers.get("x-litellm-model-api-base")
            a.retries = int(r.headers.get("x-litellm-attempted-retries", -1))
            if r.status_code != 200:
                text = r.read().decode(errors="replace")
                try:
                    err = json.loads(text).get("error")
                except ValueError:
                    err = None
                clean = (r.status_code >= 500 or r.status_code == 429) and isinstance(err, dict)
                a.outcome, a.detail = ("clean" if clean else "unclean"), f"{r.status_code}: {text[:300]}"
                return
            finish, done, content, calls, error = None, False, "", {}, None
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    continue
                ev = json.loads(payload)
                if "error" in ev:
                    error = ev["error"]
                    continue
                for ch in ev.get("choices") or []:
                    d = ch.get("delta") or {}
                    content += d.get("content") or ""
                    for tc in d.get("tool_calls") or []:
                        slot = calls.setdefault(tc.get("index", 0), {"function": {"name": None, "arguments": ""}})
                        f = tc.get("function") or {}
                        slot["function"]["name"] = slot["function"]["name"] or f.get("name")
                        slot["function"]["arguments"] += f.get("arguments") or ""
                    finish = ch.get("finish_reason") or finish
            if error is not None:
                a.outcome, a.detail = "clean", f"SSE error event: {str(error)[:300]}"
            elif finish is None:
                a.outcome, a.detail = "unclean", f"stream ended without a finish_reason or an error (done={done}, {len(content)} chars)"
            else:
                msg = {"content": content or None, "tool_calls": list(calls.values()) or None}
                if kind_of(body) != "tools":
                    msg["content"] = content
                why = check_message(body, msg)
                a.outcome, a.detail = ("unclean", why) if why else ("ok", "")
    except (httpx.RemoteProtocolError, httpx.ReadError) as e:
        # the proxy closed a connection under a reply: not what a clean error is
        a.outcome, a.detail = "unclean", f"{type(e).__name__}: {e}"
    except httpx.TimeoutException as e:
        a.outcome, a.detail = "unclean", f"timeout {type(e).__name__}"
    finally:
        a.end = time.monotonic()


@dataclass
class Run:
    attempts: list[Attempt] = field(default_factory=list)
    answered: dict[int, Attempt] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def drive(proxy_url: str, n: int, workers: int, run: Run, on_done=None, client_retries: int = 3, first: int = 0) -> None:
    """Requests first..first+n-1 from `workers` threads; each retried by the client (after 0.5 s)
    while its attempt ends in a clean error, at most `client_retries` times."""
    url = proxy_url + "/v1/chat/completions"
    next_i = iter(range(first, first + n))
    take = threading.Lock()

    def worker():
        with httpx.Client(timeout=httpx.Timeout(120, connect=10)) as client:
            while True:
                with take:
                    i = next(next_i, None)
                if i is None:
                    return
                body = request_body(i)
                for k in range(client_retries + 1):
                    a = Attempt(i, k, time.monotonic())
                    one_attempt(client, url, body, a)
                    with run.lock:
                        run.attempts.append(a)
                    if a.outcome != "clean":
                        break
                    time.sleep(0.5)
                if a.outcome == "ok":
                    with run.lock:
                        run.answered[i] = a
                if on_done:
                    on_done(i, a)

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@dataclass
class FleetResult:
    run: Run
    boards: list[str]
    t0: float
    killed: float
    restarted: float
    restarted_ready: float
    readmitted: float | None
    times: dict
    logdir: Path
    proxy_exit: int | None = None  # the proxy's exit status if it ended during the run (-N: signal N)


def fleet_run(bundle: Path, litellm: str, logdir: Path, n: int = 40, workers: int = 4, kill_after: int = 10,
              restart_after: int = 26, readmit_timeout: float = 120,
              routing: str | None = None) -> FleetResult:
    """Two boards behind LiteLLM; `n` requests from `workers` clients; board 2 SIGKILLed once
    `kill_after` requests are answered, restarted once `restart_after` are; then more requests
    (not counted in `n`) until board 2 answers one again, or `readmit_timeout` s."""
    logdir.mkdir(parents=True, exist_ok=True)
    keyfile = logdir / "keys"
    keyfile.write_text(BOARD_KEY + "\n")
    ports = [free_port(), free_port()]
    boards = [Board(bundle, p, keyfile, logdir, f"board{i}") for i, p in enumerate(ports, 1)]
    proxy = Proxy(litellm, doc_config(ports, routing), free_port(), logdir)
    times: dict = {}
    try:
        for b in boards:
            b.start()
        times["board_ready_s"] = [round(b.wait_ready(), 2) for b in boards]
        times["litellm_ready_s"] = round(proxy.wait_ready(), 2)
        run = Run()
        ev = {"killed": None, "restarted": None, "ready": None}
        done = [0]
        dead = boards[1]

        def restart():
            dead.start()
            dead.wait_ready()
            ev["ready"] = time.monotonic()

        restarter: list[threading.Thread] = []

        def on_done(i, a):
            with run.lock:
                done[0] += 1
                k = done[0]
            if k == kill_after:
                dead.kill()
                ev["killed"] = time.monotonic()
            elif k == restart_after:
                ev["restarted"] = time.monotonic()
                t = threading.Thread(target=restart)
                t.start()
                restarter.append(t)

        t0 = time.monotonic()
        drive(proxy.url, n, workers, run, on_done)
        for t in restarter:
            t.join()
        if ev["ready"] is None:  # fewer answers than restart_after: restart now
            ev["restarted"] = time.monotonic()
            restart()
        # put back: more requests until board 2 answers one after its restart
        readmitted = None
        extra = n
        deadline = time.monotonic() + readmit_timeout
        while readmitted is None and time.monotonic() < deadline and proxy.proc.poll() is None:
            drive(proxy.url, 2, 2, run, first=extra)
            extra += 2
            with run.lock:
                back = [a for a in run.attempts if a.board == dead.base and a.start > ev["ready"] and a.outcome == "ok"]
            if back:
                readmitted = min(a.start for a in back)
            else:
                time.sleep(0.5)
        return FleetResult(run, [b.base for b in boards], t0, ev["killed"], ev["restarted"], ev["ready"], readmitted,
                           times, logdir, proxy.proc.poll())
    finally:
        proxy.stop()
        for b in boards:
            b.stop()


def measured(res: FleetResult) -> dict:
    """The times docs/fleet.md gives, from the attempts' record (seconds from the SIGKILL, or from
    the restarted board's ready)."""
    dead = res.boards[1]
    after = [a for a in res.run.attempts if a.end > res.killed]
    failed = [a for a in after if a.outcome != "ok"]
    slowed = [a for a in after if a.outcome == "ok" and (a.retries or 0) > 0]  # LiteLLM retried it elsewhere
    hit_dead = failed + slowed
    last_hit = max((a.end for a in hit_dead if a.end < res.restarted), default=None)
    ok_after = [a for a in after if a.outcome == "ok" and a.start > res.killed]
    out = dict(res.times)
    out.update(
        attempts=len(res.run.attempts), answered=len(res.run.answered),
        client_retries=sum(1 for a in res.run.attempts if a.n > 0),
        clean_errors=sum(1 for a in res.run.attempts if a.outcome == "clean"),
        unclean=[(a.i, a.detail) for a in res.run.attempts if a.outcome == "unclean"],
        litellm_retried=sum(1 for a in res.run.attempts if (a.retries or 0) > 0),
        errors_after_kill=[(a.i, round(a.end - res.killed, 2), a.detail[:120]) for a in failed],
        first_ok_after_kill_s=round(min(a.end for a in ok_after) - res.killed, 2) if ok_after else None,
        last_request_touching_dead_board_s=round(last_hit - res.killed, 2) if last_hit else None,
        restart_to_ready_s=round(res.restarted_ready - res.restarted, 2),
        ready_to_readmitted_s=round(res.readmitted - res.restarted_ready, 2) if res.readmitted else None,
        kill_to_readmitted_s=round(res.readmitted - res.killed, 2) if res.readmitted else None,
        served_by={b: sum(1 for a in res.run.attempts if a.board == b and a.outcome == "ok") for b in res.boards},
        dead_board_ok_while_dead=sum(1 for a in res.run.attempts if a.board == dead and a.outcome == "ok"
                                     and res.killed < a.start and a.end < res.restarted_ready),
    )
    return out


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path)
    p.add_argument("--litellm", default=litellm_path())
    p.add_argument("--logs", type=Path, default=Path("/tmp/edgekv-fleet"))
    p.add_argument("--report", type=Path)
    p.add_argument("--routing", help="replace the document's routing_strategy (a comparison)")
    p.add_argument("--readmit-timeout", type=float, default=120)
    args = p.parse_args()
    if not args.litellm:
        sys.exit("fleet: no litellm (pip install 'litellm[proxy]' in a venv; --litellm PATH)")
    shutil.rmtree(args.logs, ignore_errors=True)
    res = fleet_run(args.bundle, args.litellm, args.logs, readmit_timeout=args.readmit_timeout, routing=args.routing)
    m = measured(res)
    print(json.dumps(m, indent=1))
    if args.report:
        args.report.write_text(json.dumps({"measured": m, "attempts": [a.__dict__ for a in res.run.attempts]}, indent=1))
