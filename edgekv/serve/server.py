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

import logging
import signal
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
from edgekv.serve.listen import BackgroundServer, Gate, _import_serving, listen_socket, url_of
from edgekv.serve.signals import Signals, Stop, notify

ACCESS_LOG = "edgekv.serve"  # the app's access lines (one per request)


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
            f"({(cache.nbytes - cache.local_bytes) / mib:.1f} MiB) + {cache.rings} rings of {cache.local_ring} cells "
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


def sampling_line(d) -> str:
    """The load line on the sampling a request that sets none gets."""
    return (f"sampling defaults: temperature {d.temperature:g}, top_p {d.top_p:g}, top_k {d.top_k}, "
            f"repeat_penalty {d.repeat_penalty:g} ({d.source}); a request's own fields override them")


def build(rt: Runtime, ctx: int | None = None, parallel: int = 4, max_queue: int = 64, api_key: str | None = None,
          prefill_chunk: int = PREFILL_CHUNK, slots=0, **server):
    """(batcher, ASGI app) over a runtime, the app ready at once (tests, bench-serve)."""
    if api_key is not None:
        server["api_keys"] = [api_key]
    batcher, srv = build_server(rt, ctx, parallel, max_queue, prefill_chunk, slots, **server)
    srv.set_state("ready")
    return batcher, srv.app()


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
            unset = defaults_of(rt.bundle.manifest, args)  # what a request that sets no sampling gets
            batcher, server = build_server(rt, args.ctx, args.parallel, args.queue, slots=layout, api_keys=keys,
                                          max_body_bytes=args.max_body, bind_host=args.host, sampling_defaults=unset)
            note(f"edgekv serve: {kv_summary(batcher, rt.bundle)}")
            note(f"edgekv serve: {sampling_line(unset)}")
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
