"""Calibration does what it is for. On a tiny model with planted outlier channels (a few K and V
channels scaled x20, and one key channel with a large constant bias, as real LLMs' keys have):
- the constants: int8-static scales = channel absmax / 127 of K (after RoPE) and V, and int4 key
  offsets = channel means of K after RoPE and the rotation, both computed here independently from
  the Hugging Face model on the calibration text;
- the accuracy: int8-static and int4 calibrated beat their uncalibrated selves (scales 1.0,
  offsets 0) on the KL divergence of next-token distributions from the float model, on other text."""
import pytest
import torch

from edgekv.format.kvschemes import hadamard
from export.model import causal_mask
from tests.conftest import make_hf_folder

CALIB_TOKENS = 256  # one calibration window (export/calibrate.py runs windows of 512 from position 0)
K_OUTLIERS = [(0, 3), (1, 10)]  # (KV head, channel) rows of k_proj scaled x20
V_OUTLIERS = [(0, 5)]
# (KV head, channel, bias): a key channel with a large constant, as real LLMs' keys have. Channel 7
# pairs with 15 in RoPE at its lowest frequency, so the constant survives RoPE as a mean.
K_BIAS = [(0, 7, 30.0), (1, 7, 30.0)]


def calib_text() -> str:
    return ("The capital of France is Paris. What is the capital of Germany? Tell me about robots, trains and tea. "
            "Der schnelle braune Fuchs. Café, naïve, 東京. ") * 12


def heldout_text() -> str:
    from pydoc_data.topics import topics

    return topics["if"] + topics["while"] + topics["for"]


@pytest.fixture(scope="session")
def outlier_model(tmp_path_factory):
    import transformers

    # Qwen2: k_proj has a bias (a Llama with attention_bias also biases o_proj, which edgekv refuses)
    folder = make_hf_folder(tmp_path_factory.mktemp("tiny-outliers"), "qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    d = hf.config.hidden_size // hf.config.num_attention_heads
    with torch.no_grad():
        for layer in hf.model.layers:
            a = layer.self_attn
            for h, c in K_OUTLIERS:
                a.k_proj.weight[h * d + c] *= 20
            for h, c in V_OUTLIERS:
                a.v_proj.weight[h * d + c] *= 20
            for h, c, b in K_BIAS:
                a.k_proj.bias[h * d + c] = b
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def hf_kv(outlier_model):
    """K after RoPE and V of every layer on the calibration ids, by transformers' own RoPE:
    [(k [S, Hkv, D], v [S, Hkv, D])] per layer."""
    import transformers
    from tokenizers import Tokenizer
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    ids = Tokenizer.from_file(str(outlier_model / "tokenizer.json")).encode(calib_text(), add_special_tokens=False).ids
    assert len(ids) >= CALIB_TOKENS
    ids = ids[:CALIB_TOKENS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(outlier_model).eval()
    cfg = hf.config
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, key=(i, kv): seen.__setitem__(key, out[0].detach()))
             for i, layer in enumerate(hf.model.layers) for kv, m in (("k", layer.self_attn.k_proj),
                                                                       ("v", layer.self_attn.v_proj))]
    t = torch.tensor([ids])
    pos = torch.arange(len(ids))[None]
    with torch.no_grad():
        hf(t)
        cos, sin = hf.model.rotary_emb(seen[(0, "k")][None], pos)
    for h in hooks:
        h.remove()
    out = []
    for i in range(cfg.num_hidden_layers):
        k = seen[(i, "k")].view(1, len(ids), hkv, d).transpose(1, 2)  # [1, Hkv, S, D]
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        out.append((k[0].transpose(0, 1), seen[(i, "v")].view(len(ids), hkv, d)))
    return out


def calibrated(folder, kv: str, calibrate: bool = True):
    """The exporter's torch model for scheme kv, calibrated by the exporter's own calibration step
    on the calibration text (or left as constructed: scales 1.0, offsets 0)."""
    from export.bundle import calibrate as run_calibration
    from export.loaders import load_hf_folder
    from export.model import Transformer

    src = load_hf_folder(folder)
    m = Transformer(src.config, kv)
    m.load_state_dict(src.state_dict, strict=False)
    if calibrate:
        path = folder / "calib.txt"
        path.write_text(calib_text())
        run_calibration(m, src, kv, str(path), CALIB_TOKENS)
    return m.eval()


def test_outliers_are_planted(hf_kv):
    """The premise: the planted channels dominate the others by far."""
    k, v = hf_kv[0]
    k_abs, v_abs = k.abs().amax(0), v.abs().amax(0)  # [Hkv, D]
    for h, c in K_OUTLIERS:
        assert k_abs[h, c] > 5 * k_abs.median()
    for h, c in V_OUTLIERS:
        assert v_abs[h, c] > 5 * v_abs.median()
    for h, c, b in K_BIAS:
        assert abs(float(k[:, h, c].mean()) - b) < 0.2 * b  # a mean that RoPE did not rotate away


def test_int8_static_scales_are_channel_absmax_over_127(outlier_model, hf_kv):
    m = calibrated(outlier_model, "int8-static")
    for layer, (k, v) in zip(m.layers, hf_kv):
        # 1e-3: far inside the 0.8 % between /127 and /128, far outside float rounding
        torch.testing.assert_close(layer.attn.k_scale, k.abs().amax(0) / 127, rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(layer.attn.v_scale, v.abs().amax(0) / 127, rtol=1e-3, atol=1e-6)


def test_int8_tensor_scale_is_the_layer_absmax_over_127(outlier_model, hf_kv):
    m = calibrated(outlier_model, "int8-tensor")
    for layer, (k, v) in zip(m.layers, hf_kv):
        torch.testing.assert_close(layer.attn.k_scale, torch.full_like(layer.attn.k_scale, float(k.abs().max()) / 127),
                                   rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(layer.attn.v_scale, torch.full_like(layer.attn.v_scale, float(v.abs().max()) / 127),
                                   rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("kv", ["int4", "int4-norot"])
def test_int4_key_offsets_are_channel_means_after_rope_and_rotation(outlier_model, hf_kv, kv):
    m = calibrated(outlier_model, kv)
    for layer, (k, _) in zip(m.layers, hf_kv):
        mean = k.double().mean(0).float()  # [Hkv, D]
        want = mean @ torch.from_numpy(hadamard(mean.shape[-1])) if kv == "int4" else mean
        torch.testing.assert_close(layer.attn.k_offset, want, rtol=1e-3, atol=1e-4)
        assert float(layer.attn.k_offset.abs().max()) > 1.0  # the planted mean is there to find


def kld_vs_float(folder, model) -> float:
    """Mean KL(float || model) of the next-token distributions over the held-out text (one pass:
    the new K/V are quantized before attention, so every token attends to the quantized cache)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(heldout_text(), add_special_tokens=False).ids[:192]
    ref = calibrated(folder, "float", calibrate=False)

    def logp(m):
        s = len(ids)
        with torch.no_grad():
            out = m(torch.tensor([ids]), torch.arange(s)[None], causal_mask(0, s),
                    torch.arange(s)[None], *m.past_like(0, 1))[0][0]
        return torch.log_softmax(out.double(), -1)

    p, q = logp(ref), logp(model)
    return float((p.exp() * (p - q)).sum(-1).mean())


# Deterministic (seeded model, fixed texts). Measured: int8-static KLD 0.0099 calibrated vs 0.10 at
# scale 1.0; int4 0.106 with its keys centered vs 0.169 at offset 0 (the rest of int4's error is the
# x20 variance outliers, which no offset removes). Margins: int8-static at least 5x better, int4 20 %.
@pytest.mark.parametrize("kv, margin", [("int8-static", 0.2), ("int4", 0.8)])
def test_calibration_beats_no_calibration(outlier_model, kv, margin):
    cal = kld_vs_float(outlier_model, calibrated(outlier_model, kv))
    raw = kld_vs_float(outlier_model, calibrated(outlier_model, kv, calibrate=False))
    assert cal < margin * raw, (cal, raw)
