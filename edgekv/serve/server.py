"""`edgekv serve`: the runtime's Batcher behind the OpenAI-compatible app, served by uvicorn.

The process, in order (docs/serve.md, "Running as a service"):
1. the port is bound (a busy port or a bad host is one error line, exit 1) and uvicorn serves it on
   its own thread at once, with `Gate` answering 503 "loading" until the model is there;
2. the bundle is loaded, the batcher started and warmed up (`warm_up`), then /health says ready
   (and systemd, when it started us with Type=notify, hears READY=1);
3. the first SIGTERM or SIGINT drains: /health and new requests get 503 "draining", running ones
   finish within --drain-seconds, then exit 0; a second signal stops at once (exit 128 + signal).
The main thread owns this sequence and the signals; uvicorn never installs its own handlers."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from typing import NamedTuple

from edgekv.errors import BackendUnavailable, EdgeKVError, note
from edgekv.format.bundle import load_bundle
from edgekv.runtime.assemble import SERVE_MARGIN, Runtime, open_runtime, serve_pool
from edgekv.runtime.backends.base import PREFILL_CHUNK
from edgekv.runtime.batching import Batcher, Done, Request, Token
from edgekv.runtime.batching.layouts import MAX_PREFIXES
from edgekv.runtime.cache import KVCache
from edgekv.runtime.sampling import SamplingParams, defaults_of
from edgekv.runtime.text import StreamDecoder
from edgekv.serve import LOCAL_HOSTS
from edgekv.serve.drain import cut_the_rest

READ_TIMEOUT = 15.0  # seconds a client has to send one whole request (headers and body)
KEEP_ALIVE = 5  # seconds an idle keep-alive connection stays open (uvicorn's timer)
CUT_AFTER = 2  # seconds uvicorn waits for connections at exit once our own drain is over
ACCESS_LOG = "edgekv.serve"  # the app's access lines (one per request)


def _import_serving():
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise EdgeKVError(f"edgekv serve needs the serve extra ({e.name} is missing): pip install 'edgekv[serve]'") from None
    return uvicorn


# where serve's requests keep their K/V (docs/serve.md, "Fused slots"): --slots K
SLOTS_AUTO = "auto"
MIN_SLOT = 16  # cells of one slot at least: a prompt and some reply
# the attention serve opens ort-cpu with: the cell pool sums attention in fixed point, the graph
# as written (onnxruntime's fused attention over a shared pool is batched = alone only to ~1e-6,
# docs/fused.md); slots run GroupQueryAttention, each sequence in its own slot (batched = alone)
SERVE_ATTENTION = {0: "plain", SLOTS_AUTO: "auto"}  # any K: "fused"


def open_serve_runtime(bundle, ctx: int | None, backend: str, threads: int | None, slots=0) -> Runtime:
    """Serve's runtime for `slots` (0: the cell pool on the graph as written, whatever
    EDGEKV_ATTENTION says; K: the fused graph or one line saying why not; auto: the fused graph
    where ort-cpu fuses this bundle)."""
    attention = SERVE_ATTENTION.get(slots, "fused")
    try:
        return open_runtime(bundle, ctx=ctx, backend=backend, threads=threads, attention=attention)
    except BackendUnavailable as e:
        if attention != "fused":
            raise
        raise EdgeKVError(f"--slots {slots}: {e} (--slots 0 serves the shared cell pool)") from None


WINDOW_AUTO = -1  # Layout.window: a windowed pool's prefix cache keeps as many window copies as fit


class Layout(NamedTuple):
    """Where serve's requests keep their K/V: `slots` 0 = the shared cell pool, else that many
    fused slots of `capacity` / `slots` cells; `why`: the load line. The cell pool's local layers
    (Gemma 3) keep only their window where that is smaller: `window` None = not (--full-kv), else
    the window copies its prefix cache keeps (WINDOW_AUTO: as many as fit; --prefix-windows)."""
    slots: int
    capacity: int
    why: str
    window: int | None = WINDOW_AUTO


def serve_layout(rt: Runtime, slots, parallel: int, ctx: int | None = None, window: int | None = WINDOW_AUTO) -> Layout:
    """What `--slots` (auto, 0 or K) means on this runtime; a K that leaves a slot under MIN_SLOT
    cells, or cannot run here, is one line. `window`: Layout's (from --full-kv, --prefix-windows)."""
    capacity = ctx or rt.capacity
    if slots == 0:
        return Layout(0, capacity, "KV: the shared cell pool (--slots 0)", window)
    memory_error = _slots_unavailable(rt)
    if slots == SLOTS_AUTO:
        if memory_error is not None:
            return Layout(0, capacity, f"KV: the shared cell pool: {memory_error}", window)
        slots = parallel
    elif memory_error is not None:
        raise EdgeKVError(f"--slots {slots}: {memory_error} (--slots 0 serves the shared cell pool)")
    per = capacity // slots
    if per < MIN_SLOT:
        raise EdgeKVError(f"--slots {slots} leaves {per} cells a slot in a context of {capacity} (at least {MIN_SLOT}): "
                          f"raise --ctx or lower --slots")
    return Layout(slots, per * slots, f"KV: {slots} fused slots of {per} cells (GroupQueryAttention over the "
                                      f"{rt.bundle.scheme.name} cache; a request's context is its slot's; "
                                      f"--slots 0 serves the shared cell pool)")


def _slots_unavailable(rt: Runtime) -> str | None:
    """Why this runtime cannot run fused slots, or None."""
    try:
        rt.backend.slot_memory(1)
    except AttributeError:
        return f"{rt.backend.name} runs no fused slots"
    except BackendUnavailable as e:
        return str(e)
    return None


def make_batcher(rt: Runtime, layout: Layout, parallel: int = 4, max_queue: int = 64,
                 prefill_chunk: int = PREFILL_CHUNK) -> Batcher:
    """The batcher over `layout`'s cache (not started)."""
    if layout.slots:
        cache = KVCache(rt.bundle, layout.capacity, memory=rt.backend.slot_memory(layout.slots))
        prefixes = MAX_PREFIXES
    else:
        copies = None if layout.window == WINDOW_AUTO else layout.window
        cache, prefixes = serve_pool(rt.bundle, rt.backend, layout.capacity, layout.window is not None, parallel, copies)
    return Batcher(rt.backend, cache, parallel=layout.slots or parallel, max_queue=max_queue,
                   prefill_chunk=prefill_chunk, max_prefixes=prefixes)


def window_of(args) -> int | None:
    """Layout.window from --full-kv and --prefix-windows (both: one line)."""
    if args.full_kv and args.prefix_windows is not None:
        raise EdgeKVError("--prefix-windows counts a windowed pool's copies; --full-kv keeps every position: "
                          "give one of them")
    return None if args.full_kv else WINDOW_AUTO if args.prefix_windows is None else args.prefix_windows


def kv_summary(batcher: Batcher, bundle) -> str:
    """The load line on the KV's memory: what the pool allocated, and for a windowed pool its
    parts, what the prefix cache reuses, and the full capacity it replaces."""
    cache, mib = batcher.cache, 2 ** 20
    if cache.local_ring is None:  # (a model with local layers: theirs too, docs/serve.md says when)
        also = ", the local layers' every position too" if cache.window else ""
        return f"KV: {cache.nbytes / mib:.1f} MiB for {cache.capacity} cells{also}"
    ring, copies = cache.local_bytes // cache.rings, batcher.kv.pool.max_prefixes
    reuse = f"prefix cache: up to {copies} window copies ({ring / mib:.1f} MiB each), a cached prompt reused only " \
            f"from its end or up to {SERVE_MARGIN} tokens before it" if copies else \
        "no prefix cache (no window copies: --prefix-windows, or no room for one under the full pool's bytes)"
    full = cache.capacity * bundle.kv_bytes_per_token()
    return (f"KV: {cache.nbytes / mib:.1f} MiB: {cache.capacity} cells of the global layers "
            f"({(cache.nbytes - cache.local_bytes) / mib:.1f} MiB) + {cache.rings} rings of {cache.local_ring} slots "
            f"for the local layers ({cache.local_bytes / mib:.1f} MiB, one per running request); {reuse}; "
            f"--full-kv: every position, {full / mib:.1f} MiB, any prefix reused")


def build_server(rt: Runtime, ctx: int | None = None, parallel: int = 4, max_queue: int = 64,
                 prefill_chunk: int = PREFILL_CHUNK, slots=0, **server):
    """(batcher, app's Server) over a runtime; the batcher's thread is started. `slots`: as
    --slots (0: the cell pool, K, auto), or a Layout already chosen. `server`: the Server's own
    options (api_keys, max_body_bytes)."""
    from edgekv.serve.app import Server

    layout = slots if isinstance(slots, Layout) else serve_layout(rt, slots, parallel, ctx)
    batcher = make_batcher(rt, layout, parallel, max_queue, prefill_chunk).start()
    server.setdefault("sampling_defaults", defaults_of(rt.bundle.manifest))
    return batcher, Server(batcher, rt.codec, rt.bundle.manifest.get("name", rt.bundle.path.name),
                           bundle=rt.bundle, **server)


def build(rt: Runtime, ctx: int | None = None, parallel: int = 4, max_queue: int = 64, api_key: str | None = None,
          prefill_chunk: int = PREFILL_CHUNK, slots=0, **server):
    """(batcher, ASGI app) over a runtime, the app ready at once (tests, bench-serve)."""
    if api_key is not None:
        server["api_keys"] = [api_key]
    batcher, srv = build_server(rt, ctx, parallel, max_queue, prefill_chunk, slots, **server)
    srv.set_state("ready")
    return batcher, srv.app()


# -- the socket
def listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or one EdgeKVError saying why not (port 0: any free port)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise EdgeKVError(f"cannot listen on --host {host!r}: {getattr(e, 'strerror', None) or e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        # a restart may bind while the old process's connections sit in TIME_WAIT; a port another
        # process listens on still fails (Linux)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise EdgeKVError(_bind_failure(host, port, e)) from None
    return sock


def _bind_failure(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is already in use (another edgekv serve?): stop it or choose another --port"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host} is not an address of this machine"
    if e.errno == errno.EACCES:
        return f"no permission to listen on port {port} (ports below 1024 need privileges): choose another --port"
    return f"cannot listen on {host}:{port}: {e.strerror or e}"


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# -- uvicorn
class Gate:
    """The ASGI app uvicorn serves from the moment the port is open: 503 "loading" (the probes'
    answer, not a refused connection) until `open` hands every request to the real app."""

    BODY = json.dumps({"status": "loading"}).encode()
    ERROR = json.dumps({"error": {"message": "the model is still loading; retry shortly", "type": "server_error",
                                  "param": None, "code": "loading"}}).encode()

    def __init__(self):
        self.app = None

    def open(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        body = self.BODY if scope["path"] == "/health" else self.ERROR
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def deadline_protocol(read_timeout: float):
    """uvicorn's h11 protocol with a deadline on reading each request.

    h11 has no header timeout, and uvicorn's keep-alive timer is armed only after a response and
    stopped by the first byte that arrives, so a client sending a byte every few seconds (slowloris),
    or connecting and sending nothing, held a connection forever. Here a client has `read_timeout`
    seconds from connecting, or from the end of its previous response, to send its whole request,
    headers and body; then it gets 408 (if nothing was answered yet) and the connection is closed.
    The deadline stops once the request is read: a long streamed reply is not cut."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    owed = (h11.IDLE, h11.SEND_BODY)  # the client's side of a request still to arrive

    class ReadDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's time starts now (a pipelined one may be read already)
                self._follow()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _follow(self) -> None:
            if self.conn.their_state not in owed:
                self._disarm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(read_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # nothing of a reply sent yet
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()

    return ReadDeadline


class BackgroundServer:
    """uvicorn on a thread: `url` once started, `close()` to stop (after what runs has finished,
    at most CUT_AFTER s), `abort()` to cut every connection now. Given `sock`, serves that
    listening socket (cmd_serve binds it first); else binds host:port itself (tests, bench-serve)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, sock: socket.socket | None = None,
                 read_timeout: float = READ_TIMEOUT):
        uvicorn = _import_serving()
        sock = sock or listen_socket(host, port)
        self.server = _uvicorn_server()(uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", http=deadline_protocol(read_timeout),
            timeout_keep_alive=KEEP_ALIVE, timeout_graceful_shutdown=CUT_AFTER))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="edgekv-http",
                                       daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise EdgeKVError(f"the HTTP server could not start on {host}:{port}")
            self.thread.join(0.02)
        self.port = sock.getsockname()[1]
        self.url = url_of(host, self.port)

    def in_flight(self) -> int:
        """Requests uvicorn is still running a handler for (a reply still being written counts)."""
        return len(self.server.server_state.tasks)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=CUT_AFTER + 10)

    def abort(self) -> None:
        """Close every connection now (their handlers see a client gone and cancel their requests), then stop."""
        if self.server.loop is not None and self.thread.is_alive():
            self.server.loop.call_soon_threadsafe(self._cut)
        self.close()

    def _cut(self) -> None:
        for conn in list(self.server.server_state.connections):
            conn.transport.close()


def _uvicorn_server():
    import contextlib

    import uvicorn

    class Uvicorn(uvicorn.Server):
        """uvicorn.Server that leaves the signals to the main thread (cmd_serve; uvicorn skips them on
        another thread anyway) and keeps its event loop, for abort() to reach the connections."""

        loop: asyncio.AbstractEventLoop | None = None

        def install_signal_handlers(self) -> None:  # uvicorn before 0.29
            pass

        def capture_signals(self):  # uvicorn 0.29 and later
            return contextlib.nullcontext()

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

    return Uvicorn


# -- the process's signals
class Stop(BaseException):
    """Raised on the main thread by a signal that must end what it is doing now (while loading or
    warming up, or a second signal while draining). A BaseException, as KeyboardInterrupt is."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class Signals:
    """SIGTERM and SIGINT on the main thread. While urgent (starting, warming up, draining) a
    signal is kept and `check()`, called between those steps, raises Stop - never inside them
    (half through starting a thread or holding a lock it left serve hung or crashing at exit) -
    except `immediately()`, around loading the runtime (nothing of ours half-made there), where
    it raises Stop at once; while serving, the first one only wakes `wait_first`."""

    HANDLED = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.urgent = True
        self.defer = True  # an urgent signal waits for check(), but inside immediately()
        self.stopped = False
        self.first: int | None = None
        self.pending: int | None = None  # a signal that came while urgent: check() stops on it
        self._got = threading.Event()
        self._old: dict = {}

    def __enter__(self) -> "Signals":
        self._old = {s: signal.signal(s, self._handle) for s in self.HANDLED}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, signum, frame) -> None:
        if self.stopped:
            return  # already stopping at once: let the cleanup finish
        if self.urgent:
            self.stopped, self.pending = True, signum  # kept even where Stop is raised: see immediately()
        else:
            self.first = signum
        self._got.set()
        if self.urgent and not self.defer:
            raise Stop(signum)

    @contextlib.contextmanager
    def immediately(self):
        """Inside: a signal raises Stop where it lands (loading the runtime: minutes on a board). Code
        inside may swallow it (pybind11 turns an exception raised during onnxruntime's module init into
        an ImportError, and the backend falls back to the next provider or reports onnxruntime missing),
        so after a signal whatever the load ends with is this Stop."""
        self.check()
        self.defer = False
        try:
            yield
        except BaseException:
            if self.pending is None:
                raise
            raise Stop(self.pending) from None
        finally:
            self.defer = True
        self.check()

    def check(self) -> None:
        """A safe point while loading or draining: a signal that came stops here."""
        if self.pending is not None:
            raise Stop(self.pending)

    def serving(self) -> None:
        self.urgent = False

    def ignore(self) -> None:
        """From now on signals change nothing (the cleanup at exit is short and must finish)."""
        self.stopped = True

    def wait_first(self) -> int | None:
        while not self._got.wait(0.5):
            pass
        self.urgent = True  # from now on (draining) a signal stops at the next check
        self.check()  # one that came before serving began: nothing is being served, stop
        return self.first


def notify(state: str) -> None:
    """Tell systemd (Type=notify: NOTIFY_SOCKET) what we are doing; nothing without it."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    addr = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(state.encode(), addr)
    except OSError as e:
        note(f"edgekv serve: warning: could not notify systemd at {path}: {e.strerror or e}")


# -- warm-up and drain
WARM_UP = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi!"}]
WARM_UP_PARAMS = (SamplingParams(temperature=0.0),  # greedy
                  SamplingParams(temperature=0.7, top_k=40, top_p=0.9, repeat_penalty=1.1, seed=0))
WARM_UP_TENANT = "edgekv-warm-up"  # its own prefixes: no client is told of cached tokens it never sent


def warm_up(batcher, codec, check=lambda: None) -> int:
    """One short prefill and decode through every path a request takes, before /health says ready:
    the chat template and the tokenizer, the batcher's batched step (two sequences in one call),
    greedy and filtered sampling, the detokenizer. The first call of each costs seconds on a board
    (lazy set-up in onnxruntime or TensorRT, the weights' pages read from disk); this way the first
    client does not pay it. Returns the tokens decoded; a model that cannot decode is an error."""
    prompt = codec.chat_ids(WARM_UP)
    runs = [WarmUpRun() for _ in WARM_UP_PARAMS]
    for p, run in zip(WARM_UP_PARAMS, runs):
        batcher.submit(Request(prompt, 2, p, stop_ids=codec.stop_ids, tenant=WARM_UP_TENANT, emit=run.event))
    for run in runs:
        while not run.ended.wait(0.2):  # short waits: check() stops on a signal between them
            check()
    for run in runs:
        if run.reason not in ("stop", "length"):
            raise EdgeKVError(f"the warm-up request ended with {run.reason!r} (see the lines above): "
                              "the model cannot decode on this backend")
        dec = StreamDecoder(codec)
        for t in run.tokens:
            dec.push(t)
        dec.flush()
    return sum(len(run.tokens) for run in runs)


class WarmUpRun:
    """One warm-up request's events: its tokens, then its end."""

    def __init__(self):
        self.tokens: list[int] = []
        self.reason: str | None = None
        self.ended = threading.Event()

    def event(self, ev) -> None:
        if isinstance(ev, Token):
            self.tokens.append(ev.id)
        elif isinstance(ev, Done):
            self.reason = ev.reason
            self.ended.set()


def busy(batcher, http: BackgroundServer) -> int:
    """Requests not finished: in the batcher (running or waiting), or a reply still being written."""
    s = batcher.stats()
    return max(s["active"] + s["waiting"], http.in_flight())


def drain(server, batcher, http: BackgroundServer, seconds: float, check=lambda: None) -> None:
    """No new requests (503 "draining"), running ones finish within `seconds`, the rest are cut
    (each reply ends with an error saying so: serve/drain.py); `check()` raises Stop on a second signal."""
    server.set_state("draining")
    notify("STOPPING=1\nSTATUS=draining")
    note(f"edgekv serve: draining: {busy(batcher, http)} requests running, up to {seconds:g} s "
         "(signal again to stop now)")
    deadline = time.monotonic() + seconds
    while busy(batcher, http) and time.monotonic() < deadline:
        time.sleep(0.05)
        check()  # a second signal stops here
    left = busy(batcher, http)
    if left:
        note(f"edgekv serve: {left} requests still running after {seconds:g} s were cut")
        cut_the_rest(server, http, seconds, check)  # each ends with an error saying why, then what is left:
        http.abort()
    else:
        http.close()


# -- the command
def api_keys_of(args) -> list[str]:
    """--api-key (repeatable) and the keys of --api-key-file, one per line (# comments, blanks skipped)."""
    keys = list(args.api_key or [])
    if args.api_key_file:
        keys += _read_keys(args.api_key_file)
    for k in keys:
        if not k or not k.isascii() or not k.isprintable() or " " in k:
            raise EdgeKVError("an API key must be printable ASCII without spaces (it travels in an HTTP header)")
    return keys


def _read_keys(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise EdgeKVError(f"--api-key-file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise EdgeKVError(f"--api-key-file {path} is not UTF-8 text") from None
    keys = [s for s in (line.strip() for line in text.splitlines()) if s and not s.startswith("#")]
    if not keys:
        raise EdgeKVError(f"--api-key-file {path} holds no key (one key per line)")
    return keys


def access_log(quiet: bool) -> None:
    """The app's access lines (logger edgekv.serve, INFO) on stderr, unless --quiet (then warnings only)."""
    log = logging.getLogger(ACCESS_LOG)
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(h)
    log.setLevel(logging.WARNING if quiet else logging.INFO)
    log.propagate = False


def cmd_serve(args) -> int:
    _import_serving()
    if args.parallel < 1 or args.queue < 0:
        raise EdgeKVError("--parallel must be at least 1 and --queue at least 0")
    window = window_of(args)
    keys = api_keys_of(args)
    bundle = load_bundle(args.bundle)  # a wrong path or a broken manifest is one line before any URL
    access_log(args.quiet)
    sock = listen_socket(args.host, args.port)
    if args.host not in LOCAL_HOSTS and not keys:
        note(f"edgekv serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
             "port can use the model")
    http = rt = batcher = None
    with Signals() as signals:
        try:
            gate = Gate()
            http = BackgroundServer(gate, args.host, sock=sock, read_timeout=args.read_timeout)
            print(f"edgekv serve: {url_of(args.host, http.port)}/v1 (loading {args.bundle})", flush=True)
            notify("STATUS=loading")
            t0 = time.perf_counter()
            with signals.immediately():
                rt = open_serve_runtime(bundle, args.ctx, args.backend, args.threads, args.slots)
            layout = serve_layout(rt, args.slots, args.parallel, args.ctx, window)
            note(f"edgekv serve: {layout.why}")
            batcher, server = build_server(rt, args.ctx, args.parallel, args.queue, slots=layout, api_keys=keys,
                                          max_body_bytes=args.max_body, bind_host=args.host)
            note(f"edgekv serve: {kv_summary(batcher, rt.bundle)}")
            server.set_state("loading")
            gate.open(server.app())  # the app answers "loading" itself until ready
            signals.check()
            t1 = time.perf_counter()
            warm_up(batcher, rt.codec, signals.check)
            server.set_state("ready")
            signals.serving()
            t2 = time.perf_counter()
            print(f"edgekv serve: ready in {t2 - t0:.1f} s, warm-up {t2 - t1:.1f} s (model "
                  f"{rt.bundle.manifest.get('name')}, {rt.backend.name}, {batcher.capacity} KV cells, {batcher.parallel} "
                  f"parallel, queue {args.queue})", flush=True)
            notify("READY=1\nSTATUS=ready")
            signals.wait_first()
            drain(server, batcher, http, args.drain_seconds, signals.check)
            note("edgekv serve: stopped")
            return 0
        except Stop as s:
            if http is not None:
                http.abort()
            note(f"edgekv serve: stopped at once ({signal.Signals(s.signum).name})")
            # before ready nothing was being served: a clean stop; a second signal cut requests short
            return 128 + s.signum if signals.first is not None else 0
        finally:
            signals.ignore()
            if http is not None:
                http.close()
            sock.close()
            if batcher is not None:
                batcher.stop()
            if rt is not None:
                rt.close()
