"""One way for the serve tests to run a server: a started batcher and an app on 127.0.0.1, both
stopped at the end (tests/test_serve_http.py, test_serve_hardening.py, test_serve_structured.py,
test_reasoning.py)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

from edgekv.serve.app import Server
from edgekv.serve.server import BackgroundServer, build


class Served(NamedTuple):
    server: Server | None  # None: an app made by build() (the product's path)
    batcher: object
    url: str


@contextmanager
def served_app(batcher, app, server: Server | None = None):
    """Serve `app` over the started `batcher`; the HTTP server closed, then the batcher stopped."""
    try:
        srv = BackgroundServer(app)
    except BaseException:
        batcher.stop()
        raise
    try:
        yield Served(server, batcher, srv.url)
    finally:
        srv.close()
        batcher.stop()


def serving(rt, codec=None, with_bundle: bool = True, capacity: int = 256, parallel: int = 4, max_queue: int = 64,
            prefill_chunk: int = 32, **server_kw):
    """A Server over a fresh batcher of `capacity` cells (codec: the runtime's unless given; the
    bundle drives tools, response_format and logprobs unless `with_bundle` is false)."""
    batcher = rt.batcher(capacity=capacity, parallel=parallel, max_queue=max_queue, prefill_chunk=prefill_chunk)
    batcher.start()
    try:
        server = Server(batcher, codec or rt.codec, rt.bundle.manifest["name"],
                        bundle=rt.bundle if with_bundle else None, **server_kw)
    except BaseException:
        batcher.stop()
        raise
    return served_app(batcher, server.app(), server)


def built(rt, **build_kw):
    """The app `edgekv serve` builds (serve/server.py's build), served."""
    return served_app(*build(rt, **build_kw))
