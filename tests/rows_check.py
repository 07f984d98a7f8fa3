"""Batched = alone on a bundle, as a program (tests/test_avx2_emulated.py runs it under qemu as an
AVX2-only CPU): prints one JSON line {"padded": [...], "exact": bool, "pool": {seq: same}, "slots":
{seq: same}} — the serving pool's schedule and, for a static bundle, serve's fused slots, each
sequence's logits against its lone decode, bit for bit. `--no-pad` leaves one-row calls as they
are (to show that the emulated CPU needs the pass)."""
from __future__ import annotations

import json
import sys

import numpy as np


def same(got_toks, got_rows, want_toks, want_rows) -> bool:
    return got_toks == want_toks and all(np.array_equal(g, w) for g, w in zip(got_rows, want_rows))


def main(argv: list[str]) -> None:
    pool_bundle, slots_bundle = argv[0], argv[1]
    if "--no-pad" in argv:
        from edgekv.graph.passes import Changed
        from edgekv.runtime.backends.rows import RowPadding
        RowPadding.apply = lambda self, index: Changed(False)
    from edgekv.runtime.assemble import open_runtime
    from tests.test_serve_engine import alone, batch_schedule

    out = {}
    with open_runtime(pool_bundle, ctx=256, backend="ort-cpu", threads=1) as rt:
        out["padded"] = sorted(map(str, rt.backend.rows.padded))
        out["exact"] = bool(rt.backend.exact and rt.backend.rows.exact)
        spec, reqs, _ = batch_schedule(rt.batcher(capacity=256, parallel=4, prefill_chunk=8))
        out["pool"] = {k: same(reqs[k].out, reqs[k].logits, *alone(rt, p, n)) for k, (p, n) in spec.items()}
    from tests.test_fused_serve import CTX, SPEC, alone as alone_in_slots, schedule, slots_engine

    with open_runtime(slots_bundle, ctx=CTX, backend="ort-cpu", threads=1, attention="fused") as rt:
        if rt.backend.query_lengths:
            reqs, _, _ = schedule(slots_engine(rt))
            out["slots"] = {}
            for k, (p, n) in SPEC.items():
                want = alone_in_slots(rt, p, n)
                out["slots"][k] = same(reqs[k].out, reqs[k].logits, want.out, want.logits)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
