"""Export's default KV scheme (`--kv auto`, export/kv_gate.py): calibrated static int8 where it
keeps perplexity within 0.3 % of a float cache with the same weights on text the calibration never
saw, per-token int8 where it does not, said in one line either way."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("torch")

from edgekv.format.bundle import load_bundle  # noqa: E402
from export import kv_gate  # noqa: E402
from export.pipeline import export_bundle  # noqa: E402


def _held_out(bundle) -> dict:
    return load_bundle(bundle).manifest["kv"]["calibration"]["held_out"]


def test_auto_keeps_static_int8_where_the_check_holds(tiny_llama, tmp_path, capfd):
    out = export_bundle(str(tiny_llama), kv="auto", out=str(tmp_path / "b"), max_context=256, steps=2)
    b = load_bundle(out)
    assert b.scheme.name == "int8-static"
    check = _held_out(out)
    assert check["passed"] and check["delta_ppl"] <= kv_gate.BAR and check["window"] == 256
    assert check["text"] == "pydoc_data.topics" and check["tokens"] == kv_gate.HELD_OUT_TOKENS
    assert "int8-static kept" in capfd.readouterr().err
    # its reference is a float cache with the same weights, scored here afresh
    from export.model import Transformer
    from export.recipes import load_source

    src = load_source(tiny_llama)
    ids, _ = kv_gate.held_out_ids(src.tokenizer_json)
    ref = Transformer.loaded(src.config.for_context(256), src.state_dict).eval()
    assert abs(math.exp(kv_gate.mean_nll(ref, ids, 256)) / check["ppl_float_cache"] - 1) < 1e-5
    assert check["ppl"] != check["ppl_float_cache"]  # the int8 cache was scored, not the float one


def test_auto_falls_back_to_per_token_int8_in_one_line(tiny_llama, tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(kv_gate, "BAR", -1.0)  # no cache can be 100 % better than a float one
    out = export_bundle(str(tiny_llama), kv="auto", out=str(tmp_path / "b"), max_context=256, steps=2)
    b = load_bundle(out)
    assert b.scheme.name == "int8"
    assert "calibration" not in b.manifest["kv"]  # the per-token scheme has nothing calibrated
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "held-out check" in ln]
    assert len(lines) == 1 and "exporting per-token int8 instead" in lines[0]


def test_an_explicit_static_export_is_kept_and_says_it_missed(tiny_llama, tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(kv_gate, "BAR", -1.0)
    out = export_bundle(str(tiny_llama), kv="int8-static", out=str(tmp_path / "b"), max_context=256, steps=2)
    assert load_bundle(out).scheme.name == "int8-static" and not _held_out(out)["passed"]
    assert "kept: --kv int8-static was asked for" in capfd.readouterr().err


def test_the_default_bundle_name_is_the_int8_one(tmp_path):
    """Either choice of auto is an int8 cache: the quickstart's path does not depend on the verdict."""
    from export.destination import default_out_dir
    from export.options import ExportOptions

    opts = ExportOptions(kv="auto")
    assert opts.kv == "auto"
    assert default_out_dir("m", "int8", "float32", "int4").name == "m-int8-wint4"


def test_the_torch_perplexity_is_the_runtimes(tiny_llama, tiny_bundle_float):
    """The check's perplexity (torch, windows from position 0) = the runtime's on the same windows
    through the exported float-cache bundle (run by edgekv eval's own window scorer). Float ONNX
    matches torch to ~5e-5 in the logits (the parity check), so per token log-probs agree to
    ~1e-4 and the perplexities to far better than the 1e-3 asked here."""
    from edgekv.runtime.assemble import open_runtime
    from edgekv.tools.evaluate import run_window
    from export.model import Transformer
    from export.recipes import load_source

    src = load_source(tiny_llama)
    ids, _ = kv_gate.held_out_ids(src.tokenizer_json, 2 * 128 + 1)
    torch_ppl = math.exp(kv_gate.mean_nll(Transformer.loaded(src.config, src.state_dict).eval(), ids, 128))
    rt = open_runtime(load_bundle(tiny_bundle_float), 256, "ort-cpu", 1, max_logits_rows=128, log=None)
    try:
        gen = rt.stream(prefill_chunk=128)  # eval's own stream and window scorer
        nll, n = 0.0, 0
        for start in range(0, len(ids) - 1, 128):
            w = ids[start: start + 129]
            lp = run_window(gen, w, 0)
            nll -= float(lp[np.arange(len(w) - 1), w[1:]].sum())
            n += len(w) - 1
    finally:
        rt.close()
    assert n == 2 * 128
    assert abs(math.exp(nll / n) / torch_ppl - 1) < 1e-3, (math.exp(nll / n), torch_ppl)


def test_a_misaligned_score_would_be_seen(tiny_llama):
    """The check scores the next token: scoring the token itself instead gives another perplexity
    (the oracle above could tell the two apart)."""
    import torch

    from export.model import Transformer, causal_mask
    from export.recipes import load_source

    src = load_source(tiny_llama)
    model = Transformer.loaded(src.config, src.state_dict).eval()
    ids, _ = kv_gate.held_out_ids(src.tokenizer_json, 65)
    with torch.no_grad():
        s = 64
        logits = model(torch.tensor([ids[:-1]]), torch.arange(s)[None], causal_mask(0, s), torch.arange(s)[None],
                       *model.past_like(0, 1))[0][0]
    lp = torch.log_softmax(logits.double(), -1)
    same = -float(lp[torch.arange(s), torch.tensor(ids[:-1])].mean())
    assert abs(kv_gate.mean_nll(model, ids, 64) - same) > 1e-3


@pytest.mark.parametrize("name", ["qwen3-d32", "smollm3", "phi4-mini", "phi3.5-mini", "gemma3",
                                  pytest.param("llama3.2", marks=pytest.mark.slow),
                                  pytest.param("qwen2.5", marks=pytest.mark.slow)])
def test_every_architecture_holds_the_bar(arch_bundles, name):
    """The static scheme each architecture's fused path runs (the same exports as
    tests/test_fused_archs.py) passes its held-out check."""
    from tests.test_fused_archs import context_of
    from tests.test_fused_gemma3 import CONTEXT, GEMMA_PARITY_STEPS

    if name == "gemma3":  # the export tests/test_fused_gemma3.py makes (its window within the context)
        bundle = arch_bundles(name, "int8-static", CONTEXT, steps=GEMMA_PARITY_STEPS)
    else:
        bundle = arch_bundles(name, "int8-static", context_of(name))
    check = _held_out(bundle)
    assert check["passed"], json.dumps(check)


def test_the_cli_defaults_to_auto():
    from edgekv.cli.parsers import build_parser

    assert build_parser().parse_args(["export"]).kv == "auto"
