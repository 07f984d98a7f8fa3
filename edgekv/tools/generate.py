"""`edgekv generate`: answer one prompt, streaming."""
from __future__ import annotations

import json
import sys

from edgekv.errors import ContextOverflow, EdgeKVError
from edgekv.runtime.assemble import open_runtime
from edgekv.runtime.generate import Stats, stats_line, stats_record
from edgekv.runtime.sampling import sampling_from
from edgekv.runtime.text import StreamDecoder, system_turn


def cmd_generate(args) -> int:
    if not args.prompt.strip():
        raise EdgeKVError("empty prompt")
    with open_runtime(args.bundle, args.ctx, args.backend, args.threads) as rt:
        return generate(args, rt)


def generate(args, rt) -> int:
    codec, gen = rt.codec, rt.generator()
    if args.raw:
        ids = codec.encode(args.prompt)
    else:
        ids = codec.chat_ids(system_turn(args.system) + [{"role": "user", "content": args.prompt}])
    if len(ids) >= gen.cache.capacity:
        raise ContextOverflow(f"prompt is {len(ids)} tokens, the cache holds {gen.cache.capacity}",
                              setting="capacity", fix=f"raise {{}}, up to {rt.bundle.max_context}")
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
        print(json.dumps({"text": "".join(pieces), "tokens": dec.ids, **stats_record(st, gen.cache, gen.seq)}))
    else:
        out.write(tail + "\n")
        out.flush()
        print(stats_line(st, gen.cache, gen.seq), file=sys.stderr)
    return 0
