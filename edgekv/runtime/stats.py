"""A turn's stats: one line for the terminal, one record for --json (generate and chat)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from edgekv.runtime.cache import KVCache

if TYPE_CHECKING:
    from edgekv.runtime.batching import PoolSequence, Request


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_s: float = 0.0  # prompt in -> first token out
    prefill_s: float = 0.0
    decode_s: float = 0.0  # after the first token (which comes from the prefill)
    decode_steps: int = 0  # decode calls timed in decode_s; each makes one token (a stop token too)
    stop_reason: str = ""

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


def stats_of(req: "Request", t0: float) -> Stats:
    """A finished turn's stats, as generate prints them; t0: when the user's message came in."""
    first = req.t_submit + (req.ttft_s or 0.0)  # the first token sampled
    return Stats(prompt_tokens=len(req.prompt), new_tokens=len(req.out), ttft_s=first - t0, prefill_s=first - t0,
                 decode_s=max(0.0, req.t_last - first) if req.decode_steps else 0.0,
                 decode_steps=req.decode_steps, stop_reason=req.finish_reason or "")


def kv_line(cache: KVCache, seq: "PoolSequence") -> str:
    """What the cache holds: cells and bytes used / allocated."""
    mib = 2 ** 20
    ring = f" (local layers: last {cache.local_ring})" if getattr(cache, "local_ring", None) else ""  # a windowed cache
    return f"KV {seq.n}/{cache.capacity} cells{ring}, {cache.used_bytes(seq.n) / mib:.2f} / {cache.nbytes / mib:.2f} MiB"


def ring_note(seq: "PoolSequence") -> str:
    return " | ring: oldest tokens overwritten" if seq.wrapped else ""


def stats_line(st: Stats, cache: KVCache, seq: "PoolSequence") -> str:
    return (f"TTFT {st.ttft_s * 1000:.0f} ms | prefill {st.prompt_tokens} tok @ {st.prefill_tps:.1f} tok/s | "
            f"decode {st.new_tokens} tok @ {st.decode_tps:.1f} tok/s | {kv_line(cache, seq)}" + ring_note(seq))


def stats_record(st: Stats, cache: KVCache, seq: "PoolSequence") -> dict:
    """The stats of one reply as JSON fields."""
    return {**asdict(st), "prefill_tps": st.prefill_tps, "decode_tps": st.decode_tps, "kv_cells": seq.n,
            "kv_capacity": cache.capacity, "kv_bytes_used": cache.used_bytes(seq.n),
            "kv_bytes_allocated": cache.nbytes, "kv_scheme": cache.scheme.name, "ring_wrapped": seq.wrapped,
            "position": seq.pos}
