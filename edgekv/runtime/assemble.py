"""The one place a bundle, a backend, caches and batchers are put together."""
from __future__ import annotations

import os
from functools import cached_property

from edgekv.errors import EdgeKVError, note
from edgekv.format.bundle import Bundle, load_bundle
from edgekv.runtime.backends import MATMUL_ACCURACY, make_backend
from edgekv.runtime.backends.base import PREFILL_CHUNK, Backend
from edgekv.runtime.backends.fused import ort_refusal
from edgekv.runtime.cache import KVCache, default_capacity
from edgekv.runtime.batching import Batcher
from edgekv.runtime.batching.layouts import MAX_PREFIXES
from edgekv.runtime.batching.stream import Stream
from edgekv.runtime.text import TextCodec


RING_MARGIN = 64  # a windowed pool's slots per ring beyond the window's W - 1 (chat's truncations)
# serve's rings: a cached prefix's window (batching/prefix_windows.py) serves matches ending up to this
# many tokens before the entry's end (a repeated prompt's match stops one short)
SERVE_MARGIN = 16


def pool_cache(bundle: Bundle, backend: Backend, capacity: int, windowed: bool, parallel: int,
               margin: int = RING_MARGIN, copies: int = 0) -> KVCache:
    """A batcher's pool of `capacity` cells; `windowed` where the bundle and the backend allow it
    and it is smaller: a ring per running sequence (chat: its kept one), each W - 1 slots plus
    `margin` (a turn may give back its last tokens, a re-rendered reply, without a re-prefill);
    `copies`: ring-sized copies kept beside the pool (serve's prefix windows), counted too."""
    window = bundle.window or 0
    windowed = windowed and getattr(backend, "windows_cache", False) and \
        (parallel + copies) * (min(window - 1, capacity) + margin) < capacity
    return KVCache(bundle, capacity, memory=backend.memory, windowed=windowed, rings=parallel, margin=margin)


def serve_pool(bundle: Bundle, backend: Backend, capacity: int, windowed: bool, parallel: int,
               copies: int | None = None) -> tuple[KVCache, int]:
    """Serve's cell pool and the prefixes its cache keeps. Windowed where the bundle and the
    backend allow it and it is smaller: a ring per running sequence, and the prefix cache keeps
    a copy of one per entry (batching/prefix_windows.py): `copies` of them (None: as many as fit with
    the rings under the full pool's bytes, at most `parallel`; 0: no prefix cache); else every
    position of every layer, and MAX_PREFIXES cached prefixes (docs/serve.md, "Windowed KV").
    Asked for more copies than leave the pool smaller: one line."""
    ring = min((bundle.window or 0) - 1, capacity) + SERVE_MARGIN
    fit = (capacity - 1) // ring - parallel  # the most copies with (parallel + copies) * ring < capacity
    can = windowed and bundle.windowed and getattr(backend, "windows_cache", False)
    if can and copies is not None and copies > fit:
        held = f"{parallel} rings" + (f" and {copies} window copies" if fit >= 0 else "")
        raise EdgeKVError(f"{copies} window copies: {held} of {ring} cells are not fewer than the {capacity} cells "
                          "of the full pool", setting="prefix_windows",
                          fix=f"at most {fit} here: {{}} {fit}" if fit >= 0 else
                          "none fit beside the rings: a larger context, fewer parallel requests, or {} 0 and no prefix cache"
                          if copies else "the rings alone fill it: a larger context or fewer parallel requests")
    copies = min(parallel, fit) if copies is None else copies
    cache = pool_cache(bundle, backend, capacity, can and copies >= 0, parallel, SERVE_MARGIN, max(copies, 0))
    return cache, copies if cache.local_ring is not None else MAX_PREFIXES


class Runtime:
    """A bundle on a backend, with the cache capacity chosen for it. Caches are allocated from
    the backend's memory; `close` (or leaving a `with` block) frees the backend's buffers, so
    it comes after every cache's last use."""

    def __init__(self, bundle: Bundle, backend: Backend, capacity: int):
        self.bundle, self.backend, self.capacity = bundle, backend, capacity

    @cached_property
    def codec(self) -> TextCodec:
        return TextCodec(self.bundle)

    def stream(self, capacity: int | None = None, prefill_chunk: int = PREFILL_CHUNK) -> Stream:
        """One sequence through a batcher of its own over `capacity` cells (a windowed model's
        local layers keep a ring of their window): eval, bench, the parity check, the self-test."""
        cache = pool_cache(self.bundle, self.backend, capacity or self.capacity, True, 1, margin=0)  # never truncated
        return Stream(Batcher(self.backend, cache, parallel=1, max_queue=1, max_prefixes=0, prefill_chunk=prefill_chunk))

    def batcher(self, capacity: int | None = None, windowed: bool = False, **kw) -> Batcher:
        """A batcher over a new pool of `capacity` cells (kw: Batcher's parallel, max_queue,
        prefill_chunk, max_prefixes): serve's, with its thread started; chat's, run on the caller's.
        `windowed` (chat: one kept conversation, no prefix cache): the local layers keep a ring of
        their window per sequence, where the bundle and the backend allow it (docs/models.md)."""
        cache = pool_cache(self.bundle, self.backend, capacity or self.capacity, windowed, kw.get("parallel", 4))
        return Batcher(self.backend, cache, **kw)


    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_runtime(bundle: str | os.PathLike | Bundle, ctx: int | None = None, backend: str = "auto",
                 threads: int | None = None, max_logits_rows: int = 1, log=note,
                 matmul_accuracy: int = MATMUL_ACCURACY, attention: str | None = None) -> Runtime:
    """Load the bundle (a path, or a Bundle already loaded) and start `backend` for caches of
    `ctx` slots (default: min(2048, the bundle's verified context)). `matmul_accuracy`: the
    activations of onnxruntime's fused low-bit MatMul (quantized weights; ort backends); `attention`:
    ort-cpu's auto|fused|plain (None: EDGEKV_ATTENTION's; serve asks for plain, docs/fused.md)."""
    bundle = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    capacity = ctx or default_capacity(bundle)
    be = make_backend(backend, bundle, threads, max_logits_rows, ctx=capacity, log=log,
                      matmul_accuracy=matmul_accuracy, attention=attention)
    if log is not None:
        for line in ort_version_lines(be, bundle):
            log(line)
    return Runtime(bundle, be, capacity)


def ort_version_lines(be: Backend, bundle: Bundle) -> list[str]:
    """The load log's lines where the installed onnxruntime runs this bundle otherwise than a
    current one would (issue 40 item 3a: JetPack 6's CPython 3.10 gets onnxruntime 1.23.2 at most):
    the backend's attention line where the release is its reason (a static int8 cache that `auto`
    fuses from 1.27 runs the graph as written), and nbits8.py's line where 8-bit block weights stay
    DequantizeLinear -> MatMul. Nothing for other backends or a current onnxruntime."""
    ort = getattr(be, "ort", None)
    if ort is None or be.device != "cpu":
        return []
    lines = []
    if (refusal := ort_refusal(ort.__version__)) is not None and refusal in be.attention:
        lines.append(be.attention)
    if (line := be.nbits8.line()) is not None:
        lines.append(line)
    return lines
