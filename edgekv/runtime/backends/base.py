"""The Backend protocol: what every backend (ort-cpu, ort-cuda, trt) promises.

One `run_cells` is one graph call, the batcher's (runtime/batching/runner.py): S new tokens
against cells [0, past) of a cache, their K/V written to cells [write, write + S), positions and
the per-token key mask given whole. The backend binds the past by address (ort: the same
bindings until `past` changes; ort-cpu stages a one-token call's present and copies it to its
cell), and returns only the logits rows asked for. Which cells a sequence holds, and so what
`past`, `write` and the mask are, is the batcher's alone (its KV manager and step runner).

| backend | runs on | KV buffers | needs |
|---|---|---|---|
| `ort-cpu` | onnxruntime CPU provider | host RAM (numpy) | onnxruntime |
| `ort-cuda` | onnxruntime CUDA provider | device memory (OrtValue) | onnxruntime-gpu, a CUDA GPU |
| `trt` | a TensorRT engine (`edgekv build-engine`) | device memory (cuda-python) | tensorrt, cuda-python |
"""
from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import numpy as np

from edgekv.runtime.cache import KVCache
from edgekv.runtime.memory import KVMemory

UNLIMITED = 1 << 30  # tokens per call for a backend without a limit of its own
# prompt tokens per graph call: a call's attention scratch grows with its tokens x the past, and
# at 128 an 1800-token prompt peaks ~100 MiB lower than at 512 and prefills no slower (docs/benchmarks.md)
PREFILL_CHUNK = 128


def bound_past(n: int, bucket: int, capacity: int) -> int:
    """Slots bound as the past for n filled ones: rounded up to the backend's bucket (so the
    binding changes once per bucket), capped at the capacity; the key mask hides the rest."""
    return min(-(-n // bucket) * bucket, capacity)


@runtime_checkable  # isinstance() checks that every member is there (tests)
class Backend(Protocol):
    name: str  # "ort-cpu" | "ort-cuda" | "trt"
    device: str  # where its KV memory is: "cpu" | "cuda"
    memory: KVMemory  # what its caches are allocated from: KVCache(bundle, ctx, memory=backend.memory)
    max_tokens_per_call: int  # the most tokens one run takes (a TensorRT engine's prefill profile)
    past_bucket: int  # the past is bound rounded up to this many slots (1: exactly the filled ones)

    def run_cells(self, cache: KVCache, past: int, write: int, input_ids: np.ndarray, position_ids: np.ndarray,
                  key_mask: np.ndarray, logits_index: np.ndarray,
                  local_key_mask: np.ndarray | None = None, ring: tuple | None = None) -> np.ndarray:
        """input_ids [1, S] (serve's fused slots: [B, S], run_slots), past = cells [0, past),
        present written at cells [write, write + S), position_ids [1, S] and the per-token mask
        [1, S, past + S] given whole (local_key_mask, the same shape: the sliding-window layers'
        mask, for a graph that has them) -> logits [1, K, V] of logits_index [1, K]: a host view
        into a buffer the backend owns (copy it to keep it). `ring`: a windowed pool's ring reads
        and writes for the local layers (runtime/batching/runner.py), given only to a backend
        whose `windows_cache` is true."""

    def close(self) -> None:
        """Free what the backend allocated (device buffers, streams). Caches allocated from its
        memory are invalid afterwards."""


def default_threads() -> int:
    """The CPU threads a command uses where --threads is not given: OMP_NUM_THREADS where it is
    set to a positive number (the variable torch and the BLAS libraries already follow, so one
    setting bounds the whole process), else every CPU this process may run on (its affinity: a
    taskset or a container's cpuset counts)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
