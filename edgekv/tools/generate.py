"""`edgekv generate`: answer one prompt, streaming; with --json-schema, --grammar or --regex the
answer is constrained to it (docs/structured.md)."""
from __future__ import annotations

import json
import sys

from edgekv.errors import ContextOverflow, EdgeKVError
from edgekv.runtime.assemble import open_runtime
from edgekv.runtime.batching import Request, Token
from edgekv.runtime.batching.request import now
from edgekv.runtime.stats import Stats, stats_line, stats_of, stats_record
from edgekv.runtime.grammar_cli import grammar_from_args
from edgekv.runtime.sampling import sampling_from
from edgekv.runtime.text import StreamDecoder, system_turn


def cmd_generate(args) -> int:
    if not args.prompt.strip():
        raise EdgeKVError("empty prompt")
    grammar = grammar_from_args(args)  # a bad grammar file is refused before the model loads
    with open_runtime(args.bundle, args.ctx, args.backend, args.threads) as rt:
        return generate(args, rt, grammar)


def generate(args, rt, grammar=None) -> int:
    """One prompt as a one-request run of the batcher (as chat's turns and serve's requests are)."""
    codec = rt.codec
    batcher = rt.batcher(windowed=True, parallel=1)  # one stream: a windowed model's local layers keep a ring
    seq = batcher.hold()  # held: the stats line reads what it holds at the end
    if args.raw:
        ids = codec.encode(args.prompt)
    else:
        ids = codec.chat_ids(system_turn(args.system) + [{"role": "user", "content": args.prompt}])
    if len(ids) >= batcher.cache.capacity:
        raise ContextOverflow(f"prompt is {len(ids)} tokens, the cache holds {batcher.cache.capacity}",
                              setting="capacity", fix=f"raise {{}}, up to {rt.bundle.max_context}")
    constraint, stop_ids = None, codec.stop_ids
    if grammar is not None:
        from edgekv.runtime.grammar_constraint import compile_grammar
        from edgekv.runtime.grammar_tokenizer import tokenizer_for

        tok = tokenizer_for(rt.bundle)
        constraint = compile_grammar(tok, grammar)
        stop_ids = stop_ids | set(tok.stop_ids)  # every end the grammar may choose ends the reply
    dec = StreamDecoder(codec)
    pieces = []
    out = sys.stdout

    def emit(event) -> None:
        if isinstance(event, Token):
            text = dec.push(event.id)
            pieces.append(text)
            if not args.json and text:
                out.write(text)
                out.flush()

    params = sampling_from(args, rt.bundle.manifest)  # unset flags: the model's defaults, as serve's
    req = Request(ids, args.max_new_tokens, params, stop_ids, emit=emit, seq=seq, constraint=constraint)
    t0 = now()
    batcher.run(req)
    st = stats_of(req, t0)
    tail = dec.flush()
    pieces.append(tail)
    record = constraint_record(grammar, constraint, st)
    if args.json:
        print(json.dumps({"text": "".join(pieces), "tokens": dec.ids, **stats_record(st, batcher.cache, seq),
                          **({"constraint": record} if record else {})}))
    else:
        out.write(tail + "\n")
        out.flush()
        print(stats_line(st, batcher.cache, seq), file=sys.stderr)
    if record and not record["complete"]:
        raise EdgeKVError(f"the reply ended by {st.stop_reason} before the {grammar.kind.replace('_', ' ')} "
                          "was complete: it is cut short (raise --max-new-tokens or --ctx)")
    return 0


def constraint_record(grammar, constraint, st: Stats) -> dict | None:
    """What --json says of the grammar: its kind, whether the reply is whole, the mask time."""
    if grammar is None:
        return None
    return {"kind": grammar.kind, "complete": st.stop_reason == "stop", "masks": constraint.masks,
            "mask_ms": round(constraint.mask_s * 1000, 3)}
