"""`edgekv serve`: the runtime's Engine behind the OpenAI-compatible app, served by uvicorn."""
from __future__ import annotations

import threading

from edgekv.errors import EdgeKVError, note
from edgekv.runtime.assemble import Runtime, open_runtime
from edgekv.runtime.backends.base import PREFILL_CHUNK

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def _import_serving():
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise EdgeKVError(f"edgekv serve needs the serve extra ({e.name} is missing): pip install 'edgekv[serve]'") from None
    return uvicorn


def build(rt: Runtime, ctx: int | None = None, parallel: int = 4, max_queue: int = 64, api_key: str | None = None,
          prefill_chunk: int = PREFILL_CHUNK):
    """(engine, ASGI app) over a runtime; the engine's thread is started."""
    from edgekv.serve.app import Server

    engine = rt.engine(capacity=ctx, parallel=parallel, max_queue=max_queue, prefill_chunk=prefill_chunk).start()
    return engine, Server(engine, rt.codec, rt.bundle.manifest.get("name", rt.bundle.path.name), api_key).app()


class BackgroundServer:
    """uvicorn on a thread (tests, bench-serve): `url` once started, `close()` to stop."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        uvicorn = _import_serving()
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise EdgeKVError(f"the server could not start on {host}:{port}")
            self.thread.join(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def cmd_serve(args) -> int:
    uvicorn = _import_serving()
    if args.parallel < 1 or args.queue < 0:
        raise EdgeKVError("--parallel must be at least 1 and --queue at least 0")
    if args.host not in LOCAL_HOSTS and not args.api_key:
        note(f"edgekv serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
             "port can use the model")
    rt = open_runtime(args.bundle, ctx=args.ctx, backend=args.backend, threads=args.threads)
    engine, app = build(rt, args.ctx, args.parallel, args.queue, args.api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"edgekv serve: http://{host}:{args.port}/v1 (model {rt.bundle.manifest.get('name')}, {rt.backend.name}, "
          f"{engine.capacity} KV cells, {engine.parallel} parallel, queue {args.queue})", flush=True)
    try:
        server.run()
    finally:
        engine.stop()
        rt.close()
    return 0
