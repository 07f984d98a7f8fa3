"""How `edgekv serve` starts, runs as a service and stops: the port bound before the URL is printed
(a busy port or a bad host is one line, exit 1; --port 0 prints the port it got), 503 "loading"
from the moment the port is open until the warm-up has decoded, SIGTERM drains (503 "draining",
the running stream completes, exit 0; a second signal stops at once; the grace period cuts the
rest), API keys from the flag and a file, the body limit, the access log, systemd's notify
messages, the read deadline against slow clients, and jetson/install-service.sh.

The server runs as a real `edgekv serve` subprocess on the tiny bundle, through HOLD_SERVE: the
real command line with two gates the test opens and closes through files (the bundle's loading,
and the engine's steps), so "while loading" and "while a stream is running" are states the test
holds the server in, not moments it races."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

for _m in ("starlette", "uvicorn", "prometheus_client"):
    pytest.importorskip(_m)
httpx = pytest.importorskip("httpx")

from tests.conftest import ROOT, run_edgekv  # noqa: E402

HOLD_SERVE = r"""
import sys, time
from pathlib import Path
from edgekv.cli import main
from edgekv.runtime.batching import Batcher
from edgekv.serve import server

gates = Path(sys.argv[1])
_open, _step = server.open_runtime, Batcher.step

def open_runtime(*a, **kw):  # waits while the file `load` exists
    while (gates / "load").exists():
        time.sleep(0.01)
    return _open(*a, **kw)

def step(self):  # while the file `steps` exists, runs only as many steps as it says
    f = gates / "steps"
    while f.exists() and not self._stop:
        n = int(f.read_text() or 0)
        if n > 0:
            f.write_text(str(n - 1))
            break
        time.sleep(0.01)
    return _step(self)

server.open_runtime, Batcher.step = open_runtime, step
sys.exit(main(sys.argv[2:]))
"""
WAIT = 120  # seconds any wait may take on a loaded machine before the test gives up (never a pass/fail timing)
JSON = {"content-type": "application/json"}
MSGS = [{"role": "user", "content": "Tell me about robots and trains."}]


class Serve:
    """One `edgekv serve` subprocess through HOLD_SERVE; `gates` is its folder of gate files."""

    def __init__(self, bundle, *flags, gates: dict | None = None, env: dict | None = None, key: str | None = None):
        self.gates = Path(tempfile.mkdtemp(prefix="ekv-gates-"))
        for name, text in (gates or {}).items():
            (self.gates / name).write_text(text)
        self.headers = {**JSON, **({"Authorization": f"Bearer {key}"} if key else {})}
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLD_SERVE, str(self.gates), "serve", str(bundle), "--port", "0", "--threads", "1",
             *map(str, flags)], stdout=self.out, stderr=self.err, cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
        self.url = self._url()

    def _url(self) -> str:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            line = self.stdout().split("\n")[0]
            if "http://" in line:
                return line.split()[2].rsplit("/v1", 1)[0]
            assert self.proc.poll() is None, f"serve exited {self.proc.returncode}: {self.stderr()}"
            time.sleep(0.05)
        raise AssertionError("serve printed no URL")

    def stdout(self) -> str:
        self.out.seek(0)
        return self.out.read()

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=30)

    def until(self, check, what: str):
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            assert self.proc.poll() is None, f"serve exited {self.proc.returncode} while waiting for {what}: " \
                                             f"{self.stderr()}"
            time.sleep(0.02)
        raise AssertionError(f"never: {what}")

    def state(self, state: str):
        """Waits until /health says `state` (its JSON), and returns that response."""
        return self.until(lambda: (lambda r: r if r.json().get("state", r.json().get("status")) == state else None)(
            self.health()), f"/health says {state}")

    def post(self, body: dict, path="/v1/chat/completions", **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=60, **kw)

    def stream(self, body: dict) -> tuple[threading.Thread, list]:
        """A streaming request on a thread; its SSE data lines land in the list as they come."""
        lines = []

        def run():
            try:
                with httpx.stream("POST", self.url + "/v1/chat/completions", json={**body, "stream": True},
                                  headers=self.headers, timeout=WAIT) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
            except httpx.HTTPError as e:  # a cut connection
                lines.append(f"CUT {type(e).__name__}")
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t, lines

    def hold_engine_after(self, steps: int) -> None:
        (self.gates / "steps").write_text(str(steps))

    def held(self) -> bool:
        f = self.gates / "steps"
        return f.exists() and f.read_text() == "0"

    def release(self, gate: str) -> None:
        (self.gates / gate).unlink(missing_ok=True)

    def wait(self) -> int:
        try:
            return self.proc.wait(WAIT)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.gates, ignore_errors=True)


@pytest.fixture
def serve(tiny_bundle_int8):
    made = []

    def start(*flags, **kw) -> Serve:
        made.append(Serve(tiny_bundle_int8, *flags, **kw))
        return made[-1]
    yield start
    for s in made:
        s.close()


def one_error_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgekv serve: error: "), r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    return lines[0]


# -- start-up
def test_busy_port_is_one_line_before_any_url(tiny_bundle_int8):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        r = run_edgekv("serve", tiny_bundle_int8, "--port", port, timeout=WAIT)
    assert r.returncode == 1
    assert f"port {port}" in one_error_line(r) and "in use" in r.stderr


def test_host_not_on_this_machine_is_one_line(tiny_bundle_int8):
    r = run_edgekv("serve", tiny_bundle_int8, "--host", "203.0.113.7", "--port", "0", timeout=WAIT)  # TEST-NET-3
    assert r.returncode == 1 and "not an address of this machine" in one_error_line(r)


def test_a_wrong_bundle_is_one_line_before_any_url(tmp_path):
    with socket.socket() as other:  # the default port busy too: the bundle is checked first
        other.bind(("127.0.0.1", 0))
        other.listen()
        r = run_edgekv("serve", tmp_path / "no-bundle", "--port", other.getsockname()[1], timeout=WAIT)
    assert r.returncode == 1 and "no-bundle" in one_error_line(r) and "in use" not in r.stderr


def test_unreadable_key_file_is_one_line(tiny_bundle_int8, tmp_path):
    r = run_edgekv("serve", tiny_bundle_int8, "--api-key-file", tmp_path / "none", timeout=WAIT)
    assert r.returncode == 1 and "--api-key-file" in one_error_line(r)
    (tmp_path / "empty").write_text("# only a comment\n\n")
    r = run_edgekv("serve", tiny_bundle_int8, "--api-key-file", tmp_path / "empty", timeout=WAIT)
    assert r.returncode == 1 and "holds no key" in one_error_line(r)


def test_loading_until_the_warm_up_has_decoded(serve):
    """--port 0 prints the port it got; the port answers 503 "loading" while the bundle loads
    (held) and while the warm-up runs (its engine steps held); ready only after the warm-up's two
    requests decoded; systemd hears loading, READY=1, then STOPPING=1."""
    notify_dir = Path(tempfile.mkdtemp(prefix="ekv-n-"))
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ns:
            ns.bind(str(notify_dir / "notify"))
            ns.settimeout(WAIT)
            s = serve(gates={"load": "", "steps": "0"}, env={"NOTIFY_SOCKET": str(notify_dir / "notify")})
            assert not s.url.endswith(":0") and int(s.url.rsplit(":", 1)[1]) > 0
            assert ns.recv(4096) == b"STATUS=loading"
            r = s.health()  # the bundle is not even loaded: the gate answers
            assert r.status_code == 503 and r.json() == {"status": "loading"}
            r = s.post({"messages": MSGS, "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and "retry-after" in r.headers
            s.release("load")
            r = s.until(lambda: (lambda r: r if "capacity" in r.json() else None)(s.health()), "the app answers")
            assert r.status_code == 503 and r.json()["state"] == "loading"  # the warm-up is held
            assert r.json()["generated_tokens"] == 0
            r = s.post({"messages": MSGS, "max_tokens": 2})
            assert r.status_code == 503
            s.release("steps")
            r = s.state("ready")
            assert r.status_code == 200
            # the warm-up went through the engine before ready: two sequences, decoded
            assert r.json()["requests"] == 2 and r.json()["generated_tokens"] >= 2
            assert ns.recv(4096) == b"READY=1\nSTATUS=ready"
            # the warm-up's prompt, sent by a client: nothing of it is reported cached (not its own)
            from edgekv.serve.server import WARM_UP
            r = s.post({"messages": WARM_UP, "max_tokens": 1})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert "ready" in s.stdout()
            s.proc.send_signal(signal.SIGTERM)
            assert ns.recv(4096) == b"STOPPING=1\nSTATUS=draining"
            assert s.wait() == 0
    finally:
        shutil.rmtree(notify_dir, ignore_errors=True)


# -- stop
def test_a_signal_while_loading_stops_at_once_with_0(serve):
    s = serve(gates={"load": ""})
    assert s.health().json() == {"status": "loading"}
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == 0
    assert "stopped at once (SIGTERM)" in s.stderr() and "Traceback" not in s.stderr()


def test_sigterm_drains_the_running_stream_then_exits_0(serve, tmp_path):
    """With the engine held mid-stream: SIGTERM turns /health to 503 draining, a new request gets
    503, the running stream then completes with the text it gets alone, and the exit is 0. Also:
    two API keys (flag and file), the body limit, the access log."""
    (tmp_path / "keys").write_text("# one per line\n\nfile-key\n")
    s = serve("--api-key", "flag-key", "--api-key-file", tmp_path / "keys", "--max-body", 2048,
              "--drain-seconds", 600, key="flag-key")
    s.state("ready")
    for key, status in (("flag-key", 200), ("file-key", 200), ("wrong", 401)):
        r = httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == status, key
    r = s.post({"messages": [{"role": "user", "content": "x" * 3000}], "max_tokens": 2})
    assert r.status_code == 413
    body = {"messages": MSGS, "max_tokens": 40, "temperature": 0}
    alone = s.post(body).json()
    want = alone["choices"][0]["message"]["content"]

    s.hold_engine_after(3)  # admit and prefill, two decode steps: then the stream is held mid-way
    t, lines = s.stream({**body, "stream_options": {"include_usage": True}})
    s.until(lambda: s.held() and s.health().json()["active"] == 1, "the stream is running, held")
    s.proc.send_signal(signal.SIGTERM)
    r = s.state("draining")
    assert r.status_code == 503 and r.json()["active"] == 1
    r = s.post(body)
    assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
    assert t.is_alive()  # the stream waits for the engine, not cut
    s.release("steps")
    t.join(WAIT)
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == want
    # the whole reply, finished in the drain: its usage in the last chunk (include_usage)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]
    assert s.wait() == 0
    err = s.stderr()
    assert "draining" in err and "stopped" in err and "Traceback" not in err
    # the access log: one line per request
    assert err.count("POST /v1/chat/completions 200") == 2 and "GET /v1/models 401" in err


def test_a_second_signal_stops_at_once(serve):
    s = serve("--drain-seconds", 600)
    s.state("ready")
    s.hold_engine_after(2)
    t, lines = s.stream({"messages": MSGS, "max_tokens": 40})
    s.until(lambda: s.held() and s.health().json()["active"] == 1, "the stream is running, held")
    s.proc.send_signal(signal.SIGTERM)
    s.state("draining")
    s.proc.send_signal(signal.SIGINT)
    assert s.wait() == 128 + signal.SIGINT
    t.join(WAIT)
    assert "[DONE]" not in lines  # cut, not finished
    assert "stopped at once" in s.stderr() and "Traceback" not in s.stderr()


def test_the_grace_period_cuts_what_is_still_running(serve):
    """--drain-seconds 0.5 with a stream the engine never finishes: exit 0 after the grace, the
    stream cut, its last events an error saying so and [DONE] (issue 41: never a stream that just
    stops; tests/test_serve_faults.py); --quiet: no access lines."""
    s = serve("--drain-seconds", 0.5, "--quiet")
    s.state("ready")
    s.hold_engine_after(2)
    t, lines = s.stream({"messages": MSGS, "max_tokens": 40})
    s.until(lambda: s.held() and s.health().json()["active"] == 1, "the stream is running, held")
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == 0
    t.join(WAIT)
    assert lines[-1] == "[DONE]" and "drain" in json.loads(lines[-2])["error"]["message"]
    err = s.stderr()
    assert "were cut" in err and "Traceback" not in err
    assert "GET /health" not in err  # --quiet


def test_queue_0_still_serves_an_idle_server(serve):
    s = serve("--queue", 0)
    s.state("ready")
    r = s.post({"messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200, r.text
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == 0


def test_queue_0_is_passed_through_and_explained():
    from edgekv.cli import build_parser

    ap = build_parser()
    assert ap.parse_args(["serve", "B", "--queue", "0"]).queue == 0
    sub = next(a for a in ap._actions if hasattr(a, "choices") and a.choices and "serve" in a.choices)
    assert "0: none wait" in " ".join(sub.choices["serve"].format_help().split())


# -- the warm-up itself
class FailingBatcher:
    """Ends every request with an error, as a batcher whose model gives non-finite logits does."""

    def submit(self, req):
        from edgekv.runtime.batching import Done, Usage
        req.ask.emit(Done("error", Usage(len(req.ask.prompt), 0, 0)))


def test_a_warm_up_that_cannot_decode_is_an_error(rt_int8):
    from edgekv.errors import EdgeKVError
    from edgekv.serve.server import warm_up

    with pytest.raises(EdgeKVError, match="cannot decode"):
        warm_up(FailingBatcher(), rt_int8.codec)


# -- slow clients
async def tiny_app(scope, receive, send):
    """Reads the whole body, then answers; /slow streams three pieces a while apart."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/slow":
        import asyncio
        for i in range(3):
            await send({"type": "http.response.body", "body": f"{i}".encode(), "more_body": True})
            await asyncio.sleep(READ_TIMEOUT)
    await send({"type": "http.response.body", "body": b"ok"})


READ_TIMEOUT = 0.3


@pytest.fixture
def slow_server():
    from edgekv.serve.listen import BackgroundServer

    srv = BackgroundServer(tiny_app, read_timeout=READ_TIMEOUT)
    yield srv
    srv.close()


def connect(srv) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", srv.port))
    c.settimeout(WAIT)
    return c


def closed_by_server(c: socket.socket, trickle: bytes = b"") -> bytes:
    """Sends `trickle` a byte at a time, a pause apart, until the server answers or closes;
    returns what it sent back (b"" for a bare close). Raises if it never does (socket timeout:
    WAIT when nothing is trickled, else 10 s after the trickle, which itself lasted many deadlines)."""
    got = b""
    if trickle:
        c.settimeout(10)
    for b in trickle:
        try:
            c.sendall(bytes([b]))
        except (BrokenPipeError, ConnectionResetError):
            return got
        time.sleep(READ_TIMEOUT / 3)
        c.setblocking(False)
        try:
            got += c.recv(4096)
        except BlockingIOError:
            continue
        finally:
            c.setblocking(True)
            c.settimeout(10)
        if got:
            break
    while True:
        try:
            part = c.recv(4096)
        except ConnectionResetError:
            return got
        if not part:
            return got
        got += part


def test_a_client_that_sends_nothing_is_closed(slow_server):
    with connect(slow_server) as c:
        assert closed_by_server(c).startswith(b"HTTP/1.1 408")


def test_headers_sent_a_byte_at_a_time_are_cut(slow_server):
    """Slowloris: each byte comes within uvicorn's keep-alive time, the whole never does."""
    with connect(slow_server) as c:
        head = b"GET / HTTP/1.1\r\nHost: localhost\r\n" + b"X-Slow: " + b"a" * 200
        assert closed_by_server(c, head).startswith(b"HTTP/1.1 408")


def test_the_next_request_on_a_kept_connection_has_its_deadline_too(slow_server):
    with connect(slow_server) as c:
        c.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        reply = b""
        while not reply.endswith(b"0\r\n\r\n"):  # the chunked body's end
            part = c.recv(4096)
            assert part, reply
            reply += part
        assert b"ok" in reply
        head = b"GET / HTTP/1.1\r\nHost: localhost\r\n" + b"X-Slow: " + b"a" * 200
        assert closed_by_server(c, head).startswith(b"HTTP/1.1 408")


def test_a_body_sent_a_byte_at_a_time_is_cut(slow_server):
    with connect(slow_server) as c:
        c.sendall(b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 10000\r\n\r\n")
        assert closed_by_server(c, b"b" * 180).startswith(b"HTTP/1.1 408")


def test_a_long_reply_and_the_next_request_are_not_cut(slow_server):
    """The deadline covers reading a request, not the reply: a reply streamed for longer than it
    arrives whole, and the same connection then serves the next request."""
    with httpx.Client(base_url=slow_server.url, timeout=WAIT) as h:
        assert h.get("/slow").text == "012ok"
        assert h.post("/", content=b"x" * 1000).text == "ok"


# -- jetson/install-service.sh
INSTALL = ROOT / "jetson" / "install-service.sh"
UNIT = "etc/systemd/system/edgekv-serve.service"
ENV = "etc/edgekv/serve.env"


def install(root: Path, *args, user="nobody") -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INSTALL), "--root", str(root), "--user", user, *map(str, args)],
                          capture_output=True, text=True, timeout=WAIT)


@pytest.fixture
def fake_bundle(tmp_path) -> Path:
    b = tmp_path / "my bundle"
    b.mkdir()
    (b / "edgekv.json").write_text("{}")
    return b


def test_install_writes_the_unit_and_its_environment(tmp_path, fake_bundle):
    root = tmp_path / "root"
    r = install(root, fake_bundle, "--host", "0.0.0.0", "--drain-seconds", "20", "--api-key-file",
                "/etc/edgekv/keys")
    assert r.returncode == 0, r.stderr
    unit = (root / UNIT).read_text()
    env = (root / ENV).read_text()
    assert "TimeoutStopSec=35" in unit  # the grace (20 s) and a margin: systemd's SIGKILL comes after the drain
    assert "KillSignal=SIGTERM" in unit and "Restart=on-failure" in unit and "Type=notify" in unit
    assert "User=nobody" in unit and "EnvironmentFile=/etc/edgekv/serve.env" in unit
    assert f'EDGEKV_BUNDLE="{fake_bundle.resolve()}"' in env
    assert 'EDGEKV_SERVE_FLAGS="--host 0.0.0.0 --drain-seconds 20 --api-key-file /etc/edgekv/keys"' in env
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.split("=", 1)[1].split()[1:] == ["serve", "${EDGEKV_BUNDLE}", "$EDGEKV_SERVE_FLAGS"]
    # run again (new flags): it replaces what it wrote itself
    r = install(root, fake_bundle, "--port", "8081")
    assert r.returncode == 0, r.stderr
    assert 'EDGEKV_SERVE_FLAGS="--port 8081"' in (root / ENV).read_text()
    assert "TimeoutStopSec=45" in (root / UNIT).read_text()  # the default grace, 30 s


def test_install_never_replaces_a_file_it_did_not_write(tmp_path, fake_bundle):
    root = tmp_path / "root"
    (root / UNIT).parent.mkdir(parents=True)
    (root / UNIT).write_text("[Service]\nExecStart=/bin/mine\n")
    r = install(root, fake_bundle)
    assert r.returncode != 0 and "not written by" in r.stderr and "Traceback" not in r.stderr
    assert (root / UNIT).read_text() == "[Service]\nExecStart=/bin/mine\n"
    assert not (root / ENV).exists()  # nothing half-installed


def test_install_refuses_a_symlink(tmp_path, fake_bundle):
    root = tmp_path / "root"
    target = tmp_path / "elsewhere"
    target.write_text("precious\n")
    (root / ENV).parent.mkdir(parents=True)
    (root / ENV).symlink_to(target)
    r = install(root, fake_bundle)
    assert r.returncode != 0 and "symlink" in r.stderr
    assert target.read_text() == "precious\n" and (root / ENV).is_symlink()


def test_install_refuses_bad_input(tmp_path, fake_bundle):
    root = tmp_path / "root"
    assert "edgekv.json" in install(root, tmp_path).stderr  # not a bundle
    r = install(root, fake_bundle, "--api-key", "has space")
    assert r.returncode != 0 and "whitespace" in r.stderr
    assert not (root / UNIT).exists()


def test_the_unit_verifies(tmp_path, fake_bundle):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here: the unit's syntax is not checked")
    root = tmp_path / "root"
    assert install(root, fake_bundle, user="root").returncode == 0  # systemd-analyze warns of nobody
    # verify needs the unit's binary to exist and the environment file where the unit names it:
    # check a copy that points at this root
    unit = (root / UNIT).read_text().replace("EnvironmentFile=/etc", f"EnvironmentFile={root}/etc")
    (tmp_path / "edgekv-serve.service").write_text(unit)
    (tmp_path / "edgekv-serve.service").chmod(0o644)  # the copy's mode is this test's, not the installer's
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "edgekv-serve.service")], capture_output=True,
                       text=True, timeout=WAIT)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if "edgekv-serve.service" in line]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr
