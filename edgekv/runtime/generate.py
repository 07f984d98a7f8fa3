"""Generation: chunked prefill, decode steps and the decode loop over one Sequence (generate,
eval, bench: one stream, every logits row it asks for), and the per-turn stats (one line for the
terminal, one record for --json) that generate and chat share. Chat and serve run on the Batcher
(batching/)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgekv.errors import EdgeKVError, NonFinite
from edgekv.runtime.backends.base import PREFILL_CHUNK, Backend
from edgekv.runtime.cache import KVCache
from edgekv.runtime.constraint import Constraint, constrain
from edgekv.runtime.sampling import SamplingParams, sample
from edgekv.runtime.sequence import Sequence

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


def kv_line(cache: KVCache, seq: "Sequence | PoolSequence") -> str:
    """What the cache holds: slots and bytes used / allocated."""
    mib = 2 ** 20
    ring = f" (local layers: last {cache.local_ring})" if getattr(cache, "local_ring", None) else ""  # a windowed cache
    return f"KV {seq.n}/{cache.capacity} slots{ring}, {cache.used_bytes(seq.n) / mib:.2f} / {cache.nbytes / mib:.2f} MiB"


def ring_note(seq: "Sequence | PoolSequence") -> str:
    return " | ring: oldest tokens overwritten" if seq.wrapped else ""


def stats_line(st: Stats, cache: KVCache, seq: "Sequence | PoolSequence") -> str:
    return (f"TTFT {st.ttft_s * 1000:.0f} ms | prefill {st.prompt_tokens} tok @ {st.prefill_tps:.1f} tok/s | "
            f"decode {st.new_tokens} tok @ {st.decode_tps:.1f} tok/s | {kv_line(cache, seq)}" + ring_note(seq))


def stats_record(st: Stats, cache: KVCache, seq: "Sequence | PoolSequence") -> dict:
    """The stats of one reply as JSON fields."""
    return {**asdict(st), "prefill_tps": st.prefill_tps, "decode_tps": st.decode_tps, "kv_slots": seq.n,
            "kv_capacity": cache.capacity, "kv_bytes_used": cache.used_bytes(seq.n),
            "kv_bytes_allocated": cache.nbytes, "kv_scheme": cache.scheme.name, "ring_wrapped": seq.wrapped,
            "position": seq.pos}


class Generator:
    """Runs one sequence over a cache through a backend. Each graph call is checked against the
    sequence before it runs and recorded in it after (`_call`), so an interrupted call leaves
    the sequence as it was."""

    def __init__(self, backend: Backend, cache: KVCache, seq: Sequence | None = None, prefill_chunk: int = PREFILL_CHUNK):
        self.backend, self.cache = backend, cache
        self.seq = seq if seq is not None else cache.new_sequence()
        self.prefill_chunk = min(prefill_chunk, backend.max_tokens_per_call)

    def reset(self, pos: int = 0) -> None:
        self.seq.reset(pos)

    def truncate(self, n: int) -> None:
        self.seq.truncate(n)

    def snapshot(self) -> dict[str, np.ndarray]:
        """The filled slots, in position order."""
        self._whole_cells()
        return self.cache.read(self.seq.n)

    def _whole_cells(self) -> None:
        if self.cache.local_ring is not None:  # (chat's batcher snapshots a windowed pool, with its rings)
            raise EdgeKVError("a windowed cache (its local layers keep only their window) has no snapshot of its slots")

    def restore(self, snap: dict[str, np.ndarray], ids: list[int]) -> None:
        """Continue a saved sequence: its slots and the token ids it was fed."""
        self._whole_cells()
        n = self.cache.slots_in(snap)
        self.seq.check_restore(n, ids)  # both checked before either changes
        self.cache.write(snap)
        self.seq.restore(n, ids)

    def _call(self, ids: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        """One graph call: ids [1, S] after the filled slots; logits [1, K, V] of the rows asked for."""
        self.seq.check_room(ids.shape[1])
        logits = self.backend.run(self.cache, self.seq, ids, logits_index)
        if not np.isfinite(logits).all():  # damaged weights or an overflow: never sample from it
            raise NonFinite()
        self.seq.advance(ids[0])
        return logits

    def prefill(self, ids: list[int], all_logits: bool = False, logits_from: int = 0) -> np.ndarray:
        """Feed ids in chunks; return the last token's logits [V], or with all_logits those of
        every token from index `logits_from` on [S - logits_from, V] (the head runs only there)."""
        if not ids:
            raise EdgeKVError("empty prompt: nothing to feed the model")
        self.seq.check_room(len(ids))  # the whole prompt, before any of it is fed
        out = []
        last = None
        start = 0
        while start < len(ids):
            # a ring takes a call only up to the end of its slots
            step = min(self.prefill_chunk, self.seq.max_write())
            chunk = np.asarray(ids[start: start + step], np.int64)[None]  # [1, S]
            s = chunk.shape[1]
            first = max(0, logits_from - start)  # rows of this chunk that are wanted
            wanted = all_logits and first < s
            idx = (np.arange(first, s) if wanted else np.array([s - 1]))[None].astype(np.int64)
            logits = self._call(chunk, idx)
            start += s
            if wanted:
                out.append(logits[0].copy())
            else:
                last = logits[0, -1]
        return np.concatenate(out) if all_logits else last

    def decode_step(self, token: int) -> np.ndarray:
        """One token in, its logits [V] out (a view; valid until the next call)."""
        return self._call(np.full((1, 1), token, np.int64), np.zeros((1, 1), np.int64))[0, 0]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                 stop_ids: set[int], stats: Stats | None = None, constraint: Constraint | None = None):
        """Prefill the prompt, then yield new token ids (see `decode`)."""
        stats = stats if stats is not None else Stats()
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids)
        stats.prompt_tokens = len(prompt_ids)
        stats.prefill_s = time.perf_counter() - t0
        yield from self.decode(logits, max_new_tokens, params, np.random.default_rng(params.seed), stop_ids,
                               stats, t0, constraint)

    def decode(self, logits: np.ndarray, max_new_tokens: int, params: SamplingParams, rng: np.random.Generator,
               stop_ids: set[int], stats: Stats, t0: float, constraint: Constraint | None = None):
        """The decode loop: sample from `logits` on and yield each new token id before it is fed.
        Stops at a stop token (not yielded), max_new_tokens, or when the sequence has no room
        left. The repetition penalty looks at the sequence's own ids (everything fed, the prompt
        included). A `constraint` masks each step's logits before sampling and takes each token
        sampled; a reply it declares complete stops there ("stop", no stop token needed), so a
        constrained reply is whole unless it ends by "length" or "context"."""
        seq = self.seq
        t_first = None
        for i in range(max_new_tokens):
            tok = sample(constrain(logits, constraint), params, rng, seq.recent(params.repeat_last_n))
            if constraint is not None:
                constraint.accept(tok)
            if t_first is None:
                t_first = time.perf_counter()
                stats.ttft_s = t_first - t0
            if tok in stop_ids:
                stats.stop_reason = "stop"
                return
            stats.new_tokens += 1
            yield tok
            if constraint is not None and constraint.is_done():
                stats.stop_reason = "stop"
                return
            if i == max_new_tokens - 1:
                break
            if seq.room() < 1:
                stats.stop_reason = "context"
                return
            logits = self.decode_step(tok)
            stats.decode_steps += 1
            stats.decode_s = time.perf_counter() - t_first
        stats.stop_reason = "length"
