"""The HTTP server under `edgekv serve`: the listening socket (a busy port or a bad host is one
line), uvicorn on a thread of its own, with a deadline on reading each request, and the `Gate`
that answers 503 "loading" from the moment the port is open until the app is ready."""
from __future__ import annotations

import asyncio
import errno
import json
import socket
import threading

from edgekv.errors import EdgeKVError

READ_TIMEOUT = 15.0  # seconds a client has to send one whole request (headers and body)
KEEP_ALIVE = 5  # seconds an idle keep-alive connection stays open (uvicorn's timer)
CUT_AFTER = 2  # seconds uvicorn waits for connections at exit once our own drain is over


def _import_serving():
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise EdgeKVError(f"edgekv serve needs the serve extra ({e.name} is missing): pip install 'edgekv[serve]'") from None
    return uvicorn


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
    ANTHROPIC = json.dumps({"type": "error", "error": {"type": "overloaded_error",  # /v1/messages: Anthropic's shape
                                                       "message": "the model is still loading; retry shortly"}}).encode()

    def __init__(self):
        self.app = None

    def open(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        path = scope["path"]
        body = self.BODY if path == "/health" else self.ANTHROPIC if path.startswith("/v1/messages") else self.ERROR
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
