"""`edgekv eval-context`: the policies are scored against the full-history oracle correctly."""
import json

from tests.conftest import run_edgekv


def test_policies_equal_the_oracle_when_everything_fits(tiny_bundle_float):
    from edgekv.tools.context_eval import evaluate_context

    # a cache as large as the reference: nothing is evicted or dropped, so both policies must
    # reproduce the full-history log-probs (float cache: to float precision)
    res = evaluate_context(str(tiny_bundle_float), ctx=256, turns=3, reply_tokens=16, threads=1)
    assert res["affected_turns"] == 0 and res["turns"] >= 2
    for name in ("ring", "drop-turns"):
        m = res["all_turns"][name]
        assert m["tokens"] > 10 and m["kld_mean"] < 1e-6 and m["top1_pct"] == 100.0


def test_small_ctx_separates_the_policies_and_writes_json(tiny_bundle_int8, tmp_path):
    out = tmp_path / "ctx.json"
    r = run_edgekv("eval-context", tiny_bundle_int8, "--ctx", "96", "--turns", "6", "--reply-tokens", "16",
                   "--threads", "1", "--json", out)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["affected_turns"] >= 1
    assert d["full"]["kld_mean"] == 0.0 and d["full"]["top1_pct"] == 100.0
    for name in ("ring", "drop-turns"):  # losing history must cost something on the affected turns
        assert d[name]["tokens"] > 0 and d[name]["kld_mean"] > 0
    assert "KLD vs full" in r.stdout
