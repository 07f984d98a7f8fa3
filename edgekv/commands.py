"""Runtime commands: generate (and the pieces chat, bench and eval share)."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict

from edgekv.backends import make_backend
from edgekv.cache import KVCache
from edgekv.errors import ContextOverflow, EdgeKVError
from edgekv.generate import Generator, SamplingParams, Stats
from edgekv.manifest import load_bundle
from edgekv.text import StreamDecoder, TextCodec, system_turn


def open_runtime(bundle_path: str, ctx: int | None, backend: str = "auto", threads: int | None = None,
                 max_logits_rows: int = 1):
    bundle = load_bundle(bundle_path)
    codec = TextCodec(bundle)
    capacity = ctx or min(2048, bundle.max_context)
    be = make_backend(backend, bundle, threads, max_logits_rows, ctx=capacity, log=_note)
    cache = KVCache(bundle, capacity, memory=be.memory)
    return bundle, codec, Generator(be, cache)


def _note(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sampling_from(args) -> SamplingParams:
    if args.repeat_last_n < 0:
        raise EdgeKVError(f"--repeat-last-n must be 0 (off) or more (got {args.repeat_last_n})")
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n, seed=args.seed)


def stats_line(st: Stats, cache: KVCache) -> str:
    mib = 2 ** 20
    return (f"TTFT {st.ttft_s * 1000:.0f} ms | prefill {st.prompt_tokens} tok @ {st.prefill_tps:.1f} tok/s | "
            f"decode {st.new_tokens} tok @ {st.decode_tps:.1f} tok/s | KV {cache.n}/{cache.capacity} slots, "
            f"{cache.used_bytes() / mib:.2f} / {cache.nbytes / mib:.2f} MiB")


def cmd_generate(args) -> int:
    if not args.prompt.strip():
        raise EdgeKVError("empty prompt")
    bundle, codec, gen = open_runtime(args.bundle, args.ctx, args.backend, args.threads)
    if args.raw:
        ids = codec.encode(args.prompt)
    else:
        ids = codec.chat_ids(system_turn(args.system) + [{"role": "user", "content": args.prompt}])
    if len(ids) >= gen.cache.capacity:
        raise ContextOverflow(f"prompt is {len(ids)} tokens, the cache holds {gen.cache.capacity} "
                              f"(raise --ctx, up to {bundle.max_context})")
    st = Stats()
    dec = StreamDecoder(codec)
    pieces = []
    out = sys.stdout
    for tok in gen.generate(ids, args.max_new_tokens, sampling_from(args), codec.stop_ids, st):
        text = dec.push(tok)
        pieces.append(text)
        if not args.json and text:
            out.write(text)
            out.flush()
    tail = dec.flush()
    pieces.append(tail)
    if args.json:
        print(json.dumps({"text": "".join(pieces), "tokens": dec.ids, **asdict(st),
                          "prefill_tps": st.prefill_tps, "decode_tps": st.decode_tps,
                          "kv_bytes_used": gen.cache.used_bytes(), "kv_bytes_allocated": gen.cache.nbytes,
                          "kv_scheme": bundle.scheme.name}))
    else:
        out.write(tail + "\n")
        out.flush()
        print(stats_line(st, gen.cache), file=sys.stderr)
    return 0
