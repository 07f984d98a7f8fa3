"""Prometheus metrics of the server (prometheus_client, a registry of its own): requests by
endpoint and status and the TTFT histogram are recorded by the handlers; everything the batcher
counts (tokens in and out, queue, KV cells) is read from it at each scrape."""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class BatcherCollector:
    def __init__(self, batcher):
        self.batcher = batcher
        self.last = (time.monotonic(), 0)  # for tokens/s since the previous scrape

    def collect(self):
        st = self.batcher.stats()
        for key, help_ in (("prompt_tokens", "prompt tokens received"),
                           ("reused_tokens", "prompt tokens taken from the prefix cache (not prefilled)"),
                           ("prefilled_tokens", "prompt tokens run through the model"),
                           ("generated_tokens", "tokens generated"),
                           ("steps", "batcher steps (a plan of the running requests' pieces: one graph call or more)"),
                           ("moved_cells", "KV cells copied by compaction (sequences' cells kept low, cached ones high)"),
                           ("compaction_seconds", "time spent copying cells for compaction")):
            yield CounterMetricFamily(f"edgekv_{key}", help_, value=st[key])
        now, n = time.monotonic(), st["generated_tokens"]
        t0, n0 = self.last
        self.last = (now, n)
        yield GaugeMetricFamily("edgekv_generated_tokens_per_second", "generation rate since the previous scrape",
                                value=(n - n0) / (now - t0) if now > t0 else 0.0)
        for key, help_ in (("waiting", "requests in the wait queue"), ("active", "sequences being decoded"),
                           ("cells_used", "KV cells in use (sequences and the prefix cache)"),
                           ("cells_free", "free KV cells"),
                           ("cells_cached_only", "KV cells held only by the prefix cache (reclaimable)"),
                           ("cells_bound", "KV cells a step binds as its past (its attention's length)"),
                           ("capacity", "KV cells in the pool"),
                           ("kv_bytes", "bytes of the KV pool (a windowed pool: the global layers' cells and the "
                                        "local layers' rings)"),
                           ("kv_local_rings", "rings of the local layers' window (a windowed pool; 0: none)"),
                           ("kv_prefix_window_bytes", "host bytes of the cached prefixes' window copies")):
            yield GaugeMetricFamily(f"edgekv_{key}", help_, value=st[key])


class Metrics:
    def __init__(self, batcher):
        self.registry = CollectorRegistry()
        self.requests = Counter("edgekv_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=self.registry)
        self.ttft = Histogram("edgekv_ttft_seconds", "request in to first token out", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.disconnects = Counter("edgekv_client_disconnects", "requests whose client hung up before the whole "
                                   "answer (cancelled in the batcher)", registry=self.registry)
        self.registry.register(BatcherCollector(batcher))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def disconnect(self) -> None:
        self.disconnects.inc()

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
