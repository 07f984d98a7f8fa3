"""Every number `edgekv eval` and `edgekv eval-context` print, against an outside oracle.

eval: PPL is transformers' own loss (the HF model, its own label shift) over the same windows and
scored positions; KLD is KL(float || candidate) computed here from the two bundles' logits, with the
float bundle as the reference in whatever order the bundles are given; top-1 agreement and the
± error bars by their definitions. eval-context: its KLD, top-1 and reply PPL recomputed here from
the logits of the full-history run and of each policy's run."""
import io
import math
import re

import numpy as np
import pytest
import torch

from edgekv.runtime.backends import OrtBackend
from edgekv.runtime.cache import KVCache
from tests.stream_reference import Generator
from edgekv.format.bundle import load_bundle

CTX, STRIDE, WINDOWS = 64, 48, 3  # overlapping windows: the stride is honoured, not ctx + 1
FIRST = CTX // 2  # each window scores the tokens that have at least ctx/2 tokens of context


def eval_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in ("assert", "break", "continue", "if", "pass", "while"))


def window_starts(n_ids: int) -> list[int]:
    return list(range(0, n_ids - CTX, STRIDE))[:WINDOWS]


def log_probs(logits) -> np.ndarray:
    """log softmax in float64, written out (not edgekv's helper)."""
    x = np.asarray(logits, np.float64)
    return x - (np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) + x.max(-1, keepdims=True))


def kl(ref_logits, cand_logits) -> np.ndarray:
    """KL(ref || cand) per row = sum_v p_ref(v) * log(p_ref(v) / p_cand(v))."""
    p = np.exp(log_probs(ref_logits))
    return (p * (np.log(p) - log_probs(cand_logits))).sum(-1)


def runtime_logits(bundle_path, ids: list[int]) -> np.ndarray:
    """All rows' logits of one uncached pass over ids (an oracle path unlike eval's: no logits_from)."""
    b = load_bundle(bundle_path)
    g = Generator(OrtBackend(b, threads=1, max_logits_rows=len(ids)), KVCache(b, len(ids)), prefill_chunk=len(ids))
    return g.prefill(ids, all_logits=True)


@pytest.fixture(scope="session")
def oracle(tiny_llama, tiny_bundle_float, tiny_bundle_int8):
    """Per window: HF's loss and per-token NLL, and each bundle's scored logits."""
    import transformers
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tiny_llama / "tokenizer.json")).encode(eval_text(), add_special_tokens=False).ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    out = {"hf_loss": [], "hf_nll": [], "float": [], "int8": []}
    for s in window_starts(len(ids)):
        win = ids[s: s + CTX + 1]
        t = torch.tensor([win])
        labels = t.clone()
        labels[0, : FIRST + 1] = -100  # HF shifts labels itself: position i's logits predict labels[i + 1]
        with torch.no_grad():
            r = hf(input_ids=t, labels=labels)
        out["hf_loss"].append(float(r.loss))
        lp = torch.log_softmax(r.logits[0, :-1].double(), -1)
        out["hf_nll"].append(-lp[torch.arange(CTX), t[0, 1:]][FIRST:].numpy())
        for name, path in (("float", tiny_bundle_float), ("int8", tiny_bundle_int8)):
            out[name].append(runtime_logits(path, win[:-1])[FIRST:])
        out.setdefault("targets", []).append(np.asarray(win[FIRST + 1:]))
        # the float bundle is the HF model: the link that makes the runtime's logits an oracle too
        np.testing.assert_allclose(out["float"][-1], r.logits[0, FIRST:-1].numpy(), atol=2e-4, rtol=1e-4)
    assert len(out["hf_loss"]) == WINDOWS
    return out


def run_eval(paths) -> tuple[dict, str]:
    from edgekv.tools.evaluate import evaluate

    buf = io.StringIO()
    res = evaluate([str(p) for p in paths], eval_text(), ctx=CTX, chunks=WINDOWS, stride=STRIDE, out=buf)
    return res, buf.getvalue()


def printed(text: str, scheme: str) -> dict:
    """The numbers of one scheme's block as printed."""
    block = text.split(f"\n{scheme} (")[1]
    m = re.search(r"PPL = ([\d.]+) ± ([\d.]+)\s+ΔPPL = ([-+\d.]+)", block)
    k = re.search(r"mean KLD = ([\d.]+) ± ([\d.]+)\s+KLD p99 = ([\d.]+)\s+top-1 agreement = ([\d.]+) %", block)
    return {"ppl": float(m[1]), "ppl_err": float(m[2]), "dppl": float(m[3]), "kld_mean": float(k[1]),
            "kld_err": float(k[2]), "kld_p99": float(k[3]), "top1_pct": float(k[4])}


def nll_of(logits_per_window, targets) -> np.ndarray:
    return np.concatenate([-log_probs(lg)[np.arange(len(t)), t] for lg, t in zip(logits_per_window, targets)])


def test_ppl_is_transformers_loss_over_the_same_windows(oracle, tiny_bundle_float, tiny_bundle_int8):
    res, text = run_eval([tiny_bundle_float, tiny_bundle_int8])
    row = {r["scheme"]: r for r in res["results"]}
    nll = np.concatenate(oracle["hf_nll"])
    # the windows score equally many tokens, so the mean NLL is the mean of HF's per-window losses
    hf_ppl = math.exp(np.mean(oracle["hf_loss"]))
    assert np.mean(nll) == pytest.approx(np.mean(oracle["hf_loss"]), rel=1e-5)
    assert res["windows"] == WINDOWS and row["float"]["tokens_scored"] == len(nll) == WINDOWS * (CTX - FIRST)
    assert row["float"]["ppl"] == pytest.approx(hf_ppl, rel=1e-4)
    # the error bar: delta method on the mean NLL, PPL * std(NLL) / sqrt(n)
    assert row["float"]["ppl_err"] == pytest.approx(hf_ppl * np.std(nll, ddof=1) / math.sqrt(len(nll)), rel=1e-3)
    # the quantized bundle's PPL from its own logits
    int8_ppl = math.exp(nll_of(oracle["int8"], oracle["targets"]).mean())
    assert row["int8"]["ppl"] == pytest.approx(int8_ppl, rel=1e-5)
    assert row["int8"]["dppl"] == pytest.approx(int8_ppl - hf_ppl, abs=1e-3 * hf_ppl)
    for scheme in ("float", "int8"):  # what is printed is what was computed
        shown = printed(text, scheme)
        assert shown["ppl"] == pytest.approx(row[scheme]["ppl"], abs=6e-5)
        assert shown["ppl_err"] == pytest.approx(row[scheme]["ppl_err"], abs=6e-5)


@pytest.mark.parametrize("order", [("float", "int8"), ("int8", "float")])
def test_kld_and_top1_against_the_float_bundle_in_any_order(oracle, tiny_bundle_float, tiny_bundle_int8, order):
    paths = {"float": tiny_bundle_float, "int8": tiny_bundle_int8}
    res, text = run_eval([paths[n] for n in order])
    assert res["reference"] == tiny_bundle_float.name
    assert f"reference: {tiny_bundle_float.name}" in text
    row = {r["scheme"]: r for r in res["results"]}
    assert row["float"]["kld_mean"] == 0.0 and row["float"]["top1_pct"] == 100.0
    ref, q = np.concatenate(oracle["float"]), np.concatenate(oracle["int8"])
    d = kl(ref, q)
    # eval's rows are the same computation on the same logits: they agree to float64 rounding, far
    # closer than KL(int8 || float) is to KL(float || int8) (about 3e-4 apart, relative, here)
    assert abs(kl(q, ref).mean() - d.mean()) > 1e-5 * d.mean()  # the premise: the direction is measurable
    assert row["int8"]["kld_mean"] == pytest.approx(d.mean(), rel=1e-7)
    assert row["int8"]["kld_err"] == pytest.approx(np.std(d, ddof=1) / math.sqrt(len(d)), rel=1e-6)
    assert row["int8"]["kld_p99"] == pytest.approx(np.percentile(d, 99), rel=1e-6)
    top1 = 100 * np.mean(ref.argmax(-1) == q.argmax(-1))
    assert 50 < top1 < 100  # quantization flips some argmaxes: top-1 is exercised both ways
    assert row["int8"]["top1_pct"] == pytest.approx(top1, abs=1e-9)
    shown = printed(text, "int8")
    assert shown["kld_mean"] == pytest.approx(d.mean(), abs=6e-7)
    assert shown["kld_err"] == pytest.approx(row["int8"]["kld_err"], abs=6e-7)
    assert shown["top1_pct"] == pytest.approx(top1, abs=0.006)


# -- eval-context -----------------------------------------------------------------------------

@pytest.fixture(scope="session")
def context_run(tiny_bundle_int8):
    """evaluate_context at a small ctx, with every scored pass recorded: its ids, spans and raw logits."""
    import edgekv.tools.context_eval as ce

    passes = []
    real_score, real_ring = ce.score, ce.score_ring

    def recording(real):  # the full and drop-turns passes (score) and the ring's (score_ring, chat's ring)
        def scored(runner, *args):
            ids, spans = args[-2], args[-1]
            raws = []
            real_ls = ce.log_softmax
            ce.log_softmax = lambda x: (raws.append(np.array(x, np.float64)), real_ls(x))[1]
            try:
                lps = real(runner, *args)
            finally:
                ce.log_softmax = real_ls
            passes.append({"ids": list(ids), "spans": list(spans), "logits": raws})
            return lps
        return scored

    ce.score, ce.score_ring = recording(real_score), recording(real_ring)
    try:
        res = ce.evaluate_context(str(tiny_bundle_int8), ctx=96, turns=6, reply_tokens=16, threads=1, out=io.StringIO())
    finally:
        ce.score, ce.score_ring = real_score, real_ring
    return res, passes


def metrics(ref_pass, runs) -> dict:
    """KLD, top-1 and reply PPL of `runs` [(ids, (s, e), logits)] against the full-history pass."""
    kld, reverse, top1, nll = [], [], [], []
    for i, (ids, (s, e), lg) in runs:
        r = ref_pass["logits"][i]
        n = min(len(r), len(lg))  # a reply cut at the cache's end is scored as far as it got
        kld.extend(kl(r[:n], lg[:n]))
        reverse.extend(kl(lg[:n], r[:n]))
        top1.extend(r[:n].argmax(-1) == lg[:n].argmax(-1))
        tgt = np.asarray(ids[s: s + n])  # row j predicts the reply's token j
        nll.extend(-log_probs(lg[:n])[np.arange(n), tgt])
    return {"tokens": len(kld), "kld_mean": float(np.mean(kld)), "kld_reverse": float(np.mean(reverse)), "top1_pct": 100 * float(np.mean(top1)),
            "ppl": math.exp(np.mean(nll))}


def test_eval_context_numbers_from_the_two_runs_logits(context_run):
    res, passes = context_run
    full, ring, drops = passes[0], passes[1], passes[2:]
    spans = full["spans"]
    assert ring["ids"] == full["ids"] and ring["spans"] == spans and len(drops) == len(spans)
    affected = [i for i, (s, e) in enumerate(spans) if e > res["ctx"]]
    assert res["affected_turns"] == len(affected) >= 1
    runs = {"full": [(i, (full["ids"], spans[i], full["logits"][i])) for i in range(len(spans))],
            "ring": [(i, (full["ids"], spans[i], ring["logits"][i])) for i in range(len(spans))],
            # drop-turns scores each reply in its own shortened conversation: targets from its own ids
            "drop-turns": [(i, (d["ids"], d["spans"][0], d["logits"][0])) for i, d in enumerate(drops)]}
    for name in ("full", "ring", "drop-turns"):
        want = metrics(full, [(i, x) for i, x in runs[name] if i in affected])
        got = res[name]
        assert got["tokens"] == want["tokens"] > 0
        assert got["kld_mean"] == pytest.approx(want["kld_mean"], rel=1e-6, abs=1e-12)
        assert got["top1_pct"] == pytest.approx(want["top1_pct"], abs=1e-9)
        assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-9)
        if name != "full":
            assert want["kld_mean"] > 0.01  # the history loss is large: KL's direction matters here
            assert abs(want["kld_reverse"] - want["kld_mean"]) > 1e-3 * want["kld_mean"]
            all_turns = metrics(full, runs[name])
            assert res["all_turns"][name]["kld_mean"] == pytest.approx(all_turns["kld_mean"], rel=1e-6)
            assert res["all_turns"][name]["ppl"] == pytest.approx(all_turns["ppl"], rel=1e-9)
