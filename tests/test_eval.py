"""Evaluation and the KV scheme family: quantization bounds, reference KLD, outputs, refusals."""
import json

import numpy as np
import pytest
import torch

from edgekv.errors import EdgeKVError
from edgekv.tools.evaluate import evaluate, write_outputs
from edgekv.format.kvschemes import SCHEMES, dequantize_int8, get_scheme, quantize_int8, quantize_static
from export.kv_torch import kv_load, kv_store
from export.model import causal_mask
from tests.conftest import cli


def test_int8_error_within_half_a_step():
    x = np.random.default_rng(0).standard_normal((50, 1, 3, 64)).astype(np.float32) * 4
    x[3, 0, 1] = 0  # an all-zero row stays finite and exact
    q, s = quantize_int8(x)
    err = np.abs(dequantize_int8(q, s) - x)
    assert (err <= s.astype(np.float32)[..., None] / 2 + 1e-6).all()
    assert np.isfinite(s.astype(np.float32)).all() and (err[3, 0, 1] == 0).all()


@pytest.mark.parametrize("name", ["int8", "int8-static", "int8-tensor"])
def test_torch_scheme_error_within_half_a_step_and_matches_numpy(name):
    scheme = get_scheme(name)
    x = torch.randn(40, 1, 3, 16) * 3
    static = None if name == "int8" else (x.abs().amax((0, 1)) / 127 if name == "int8-static"
                                         else torch.full((3, 16), float(x.abs().max()) / 127))
    stored, x_hat = kv_store(scheme, x, static)
    torch.testing.assert_close(kv_load(scheme, stored, torch.float32, static), x_hat)  # reader sees x_hat
    step = stored[1].float()[..., None] if name == "int8" else static
    assert ((x_hat - x).abs() <= step / 2 + 1e-6).all()
    if name == "int8":
        q, s = quantize_int8(x.numpy())
        np.testing.assert_array_equal(stored[0].numpy(), q)
        np.testing.assert_array_equal(stored[1].numpy(), s)
    else:
        np.testing.assert_array_equal(stored[0].numpy(), quantize_static(x.numpy(), static.numpy()))


def test_bytes_per_token_for_smollm2():
    # DESIGN.md: SmolLM2 (30 layers x 3 KV heads x 64) fp16 23,040 B/token; int8 11,520 + 360 of scales
    assert SCHEMES["float"].bytes_per_token(30, 3, 64, 2) == 23040
    assert SCHEMES["int8"].bytes_per_token(30, 3, 64, 2) == 11520 + 360
    assert SCHEMES["int8-static"].bytes_per_token(30, 3, 64, 2) == 11520


def test_float_vs_float_kld_zero_and_outputs_written(tiny_bundle_float, tiny_bundle_int8, tmp_path):
    import shutil

    twin = tmp_path / "float-twin"
    shutil.copytree(tiny_bundle_float, twin)
    text = ("The capital of France is Paris. " * 60) + "naïve café 東京 🙂 " * 20
    res = evaluate([str(tiny_bundle_float), str(twin), str(tiny_bundle_int8)], text, ctx=64, chunks=3)
    by = {r["bundle"]: r for r in res["results"]}
    assert by["float-twin"]["kld_mean"] == 0.0 and by["float-twin"]["dppl"] == 0.0
    assert by["float-twin"]["top1_pct"] == 100.0
    assert by["tiny-int8"]["kld_mean"] > 0  # quantization does change something
    files = write_outputs(res, str(tmp_path / "out" / "eval.json"), str(tmp_path / "out" / "eval.png"))
    assert len(files) == 4
    d = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert len(d["results"]) == 3
    assert (tmp_path / "out" / "eval.csv").read_text().count("\n") == 4
    assert "| int8 |" in (tmp_path / "out" / "eval.md").read_text()
    png = (tmp_path / "out" / "eval.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_eval_labels_name_the_reference_the_weights_and_the_kv_bytes(tiny_bundle_float, tiny_bundle_int8):
    """Two bundles of the same float32 weights: the same weights MiB (4 bytes per parameter, not
    the graph file, which also holds each KV scheme's constants); the float-KV row says what a
    float32 cache costs instead of "saving -100 %"; the plot's axis names the run's reference."""
    import io

    from edgekv.format.bundle import load_bundle
    from edgekv.tools.evaluate import plot_labels

    text = "The capital of France is Paris. " * 60
    out = io.StringIO()
    res = evaluate([str(tiny_bundle_int8), str(tiny_bundle_float)], text, ctx=64, chunks=1, out=out)
    n_params = load_bundle(tiny_bundle_float).manifest["model"]["n_params"]
    assert [r["weights_mib"] for r in res["results"]] == [4 * n_params / 2**20] * 2
    printed = out.getvalue()
    assert "-100" not in printed and "no saving vs fp16 (2.00x its bytes)" in printed
    assert "its own reference" not in printed and "no float-weights float-KV bundle" not in printed
    assert res["reference_is"] == "float weights + float KV"
    assert "mean KLD vs float weights + float KV" in plot_labels(res)[1]

    alone = io.StringIO()
    res = evaluate([str(tiny_bundle_int8)], text, ctx=64, chunks=1, out=alone)
    lines = [x for x in alone.getvalue().splitlines() if "its own reference" in x]
    assert len(lines) == 1 and "tiny-int8" in lines[0]
    assert "mean KLD vs float weights + int8 KV" in plot_labels(res)[1]


def test_eval_says_when_no_float_kv_bundle_is_the_reference(tiny_bundle_int8, tmp_path):
    import io
    import shutil

    twin = tmp_path / "int8-twin"
    shutil.copytree(tiny_bundle_int8, twin)
    out = io.StringIO()
    res = evaluate([str(twin), str(tiny_bundle_int8)], "The capital of France is Paris. " * 60, ctx=64, chunks=1,
                   out=out)
    lines = [x for x in out.getvalue().splitlines() if "no float-weights float-KV bundle given" in x]
    assert len(lines) == 1 and "int8-twin (float weights + int8 KV)" in lines[0]
    assert res["reference_is"] == "float weights + int8 KV"


def test_chunked_scoring_equals_token_by_token(tiny_bundle_int8):
    """What eval scores in chunks is what decode sees one token at a time."""
    text = "The capital of France is Paris. The capital of Germany is Berlin. " * 10
    a = evaluate([str(tiny_bundle_int8)], text, ctx=64, chunks=2, prefill_chunk=64)
    b = evaluate([str(tiny_bundle_int8)], text, ctx=64, chunks=2, prefill_chunk=1)
    assert abs(a["results"][0]["ppl"] - b["results"][0]["ppl"]) < 1e-4 * a["results"][0]["ppl"]


def test_mismatched_models_refused(tiny_bundle_int8, tiny_qwen_bundle_float):
    with pytest.raises(EdgeKVError, match="different source models"):
        evaluate([str(tiny_bundle_int8), str(tiny_qwen_bundle_float)], "x " * 500, ctx=32)


def test_short_or_empty_text_refused(tiny_bundle_int8, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    r = cli("eval", tiny_bundle_int8, "--text", short, "--ctx", "64")
    assert r.returncode == 1 and "text too short" in r.stderr and "Traceback" not in r.stderr
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = cli("eval", tiny_bundle_int8, "--text", empty)
    assert r.returncode == 1 and "empty" in r.stderr and "Traceback" not in r.stderr


def test_int4_pack_roundtrip_and_error_bound():
    from edgekv.format.kvschemes import INT4_LEVELS, dequantize_int4, pack_int4, quantize_int4, unpack_int4

    c = np.random.default_rng(1).integers(0, 16, (5, 1, 3, 64)).astype(np.uint8)
    assert pack_int4(c).shape == (5, 1, 3, 32) and pack_int4(c).dtype == np.uint8
    np.testing.assert_array_equal(unpack_int4(pack_int4(c)), c)
    x = np.random.default_rng(2).standard_normal((20, 1, 3, 64)).astype(np.float32)
    packed, scale = quantize_int4(x)
    err = np.abs(dequantize_int4(packed, scale) - x).reshape(20, 1, 3, 2, 32)
    # nearest level: off by at most half the widest gap between neighbouring levels (times the scale)
    half_gap = np.diff(INT4_LEVELS).max() / 2
    assert (err <= scale.astype(np.float32)[..., None] * half_gap * (1 + 1e-3) + 1e-6).all()
    # and each value is coded to the nearest level, not merely within the bound
    lv = np.asarray(INT4_LEVELS)
    y = (x.reshape(20, 1, 3, 2, 32) / scale.astype(np.float32)[..., None]).reshape(-1)
    best = np.abs(y[:, None] - lv).min(1)
    got = np.abs(y - lv[unpack_int4(packed).reshape(-1)])
    assert (got <= best + 1e-6).all()


def test_int4_levels_are_symmetric_and_sorted():
    from edgekv.format.kvschemes import INT4_LEVELS, int4_byte_table

    lv = np.asarray(INT4_LEVELS, np.float32)
    assert len(lv) == 16 and (np.diff(lv) > 0).all() and lv[0] == -1 and lv[-1] == 1
    np.testing.assert_allclose(lv, -lv[::-1])
    t = int4_byte_table()
    assert t.shape == (256, 2) and t[0x3A, 0] == lv[0xA] and t[0x3A, 1] == lv[0x3]


def test_key_offset_is_softmax_invariant(monkeypatch):
    """Subtracting a constant vector from every key and never adding it back leaves attention
    unchanged: with quantization switched off, any key offset gives the float model's logits."""
    import export.model as M
    from export.model_config import ModelConfig

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=96, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=16)
    torch.manual_seed(0)
    ref = M.Transformer(cfg, "float").eval()
    m = M.Transformer(cfg, "int4-norot").eval()
    m.load_state_dict(ref.state_dict(), strict=False)
    for layer in m.layers:
        layer.attn.k_offset.copy_(torch.randn_like(layer.attn.k_offset) * 5)
    monkeypatch.setattr(M, "kv_store", lambda scheme, x, s=None: ([x, x], x))  # no quantization
    monkeypatch.setattr(M, "kv_load", lambda scheme, t, dtype, s=None: t[0])
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    args = (ids, torch.arange(12)[None], causal_mask(0, 12), torch.arange(12)[None])
    empty = [torch.zeros(0, 1, 2, 16)] * (2 * 2 * cfg.n_layers)  # P = 0, two tensors per K and V
    with torch.no_grad():
        a = ref(*args, *ref.past_like(0, 1))[0]
        b = m(*args, *empty)[0]
        assert all(float(layer.attn.k_offset.abs().max()) > 1 for layer in m.layers)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["int4", "int4-norot"])
def test_torch_int4_matches_numpy_reference(name):
    from edgekv.format.kvschemes import quantize_int4

    x = torch.randn(10, 1, 3, 64)
    (packed, scale), x_hat = kv_store(get_scheme(name), x)
    ref_p, ref_s = quantize_int4(x.numpy())
    np.testing.assert_array_equal(packed.numpy(), ref_p)
    np.testing.assert_array_equal(scale.numpy(), ref_s)
    torch.testing.assert_close(kv_load(get_scheme(name), [packed, scale], torch.float32), x_hat)


def test_int4_bytes_under_0_30_of_fp16():
    from edgekv.format.kvschemes import float16_bytes_per_token

    b = SCHEMES["int4"].bytes_per_token(30, 3, 64, 2)
    assert b == 30 * 2 * 3 * (32 + 2 * 2) and b / float16_bytes_per_token(30, 3, 64) <= 0.30


def test_hadamard_is_orthonormal():
    from edgekv.format.kvschemes import hadamard

    for d in (64, 24):
        h = hadamard(d)
        np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-5)
