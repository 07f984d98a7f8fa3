"""`edgekv generate`: answer one prompt, streaming; with --json-schema, --grammar or --regex the
answer is constrained to it (docs/structured.md)."""
from __future__ import annotations

import json
import sys

from edgekv.errors import ContextOverflow, EdgeKVError
from edgekv.runtime.assemble import open_runtime
from edgekv.runtime.generate import Stats, stats_line, stats_record
from edgekv.runtime.grammar import grammar_from_args
from edgekv.runtime.sampling import sampling_from
from edgekv.runtime.text import StreamDecoder, system_turn


def cmd_generate(args) -> int:
    if not args.prompt.strip():
        raise EdgeKVError("empty prompt")
    grammar = grammar_from_args(args)  # a bad grammar file is refused before the model loads
    with open_runtime(args.bundle, args.ctx, args.backend, args.threads) as rt:
        return generate(args, rt, grammar)


def generate(args, rt, grammar=None) -> int:
    codec, gen = rt.codec, rt.generator()
    if args.raw:
        ids = codec.encode(args.prompt)
    else:
        ids = codec.chat_ids(system_turn(args.system) + [{"role": "user", "content": args.prompt}])
    if len(ids) >= gen.cache.capacity:
        raise ContextOverflow(f"prompt is {len(ids)} tokens, the cache holds {gen.cache.capacity}",
                              setting="capacity", fix=f"raise {{}}, up to {rt.bundle.max_context}")
    constraint, stop_ids = None, codec.stop_ids
    if grammar is not None:
        from edgekv.runtime.grammar import compile_grammar, tokenizer_for

        tok = tokenizer_for(rt.bundle)
        constraint = compile_grammar(tok, grammar)
        stop_ids = stop_ids | set(tok.stop_ids)  # every end the grammar may choose ends the reply
    st = Stats()
    dec = StreamDecoder(codec)
    pieces = []
    out = sys.stdout
    params = sampling_from(args, rt.bundle.manifest)  # unset flags: the model's defaults, as serve's
    for tok_id in gen.generate(ids, args.max_new_tokens, params, stop_ids, st, constraint):
        text = dec.push(tok_id)
        pieces.append(text)
        if not args.json and text:
            out.write(text)
            out.flush()
    tail = dec.flush()
    pieces.append(tail)
    record = constraint_record(grammar, constraint, st)
    if args.json:
        print(json.dumps({"text": "".join(pieces), "tokens": dec.ids, **stats_record(st, gen.cache, gen.seq),
                          **({"constraint": record} if record else {})}))
    else:
        out.write(tail + "\n")
        out.flush()
        print(stats_line(st, gen.cache, gen.seq), file=sys.stderr)
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
