"""Calibration does what it is for. On a tiny model with planted outlier channels (a few K and V
channels scaled x20, and one key channel with a large constant bias, as real LLMs' keys have):
- int8-static / int8-tensor: each layer's scales are channel absmax / 127 (K after RoPE, the first
  token's keys left out where the search says so) times the headroom the search chose, the absmax
  computed here independently from the Hugging Face model; the chosen headroom is the one with the
  least attention-output error among the candidates, that error recomputed here with transformers'
  RoPE and o_proj and the numpy reference quantizer; scales are finite, positive, [Hkv, D]
  (onnxruntime GroupQueryAttention's PER_CHANNEL [1, Hkv, 1, D]);
- int4 key offsets = channel means of K after RoPE and the rotation;
- the accuracy: int8-static and int4 calibrated beat their uncalibrated selves on other text, and
  (slow) the real model's int8-static stays within a bound of the float cache on held-out text."""
import functools

import pytest
import torch

from edgekv.format.kvschemes import hadamard
from export.model import causal_mask
from tests.conftest import make_hf_folder

CALIB_TOKENS = 256  # int4: one calibration window (export/calibrate.py runs windows of 512 from position 0)
STATIC_WINDOW = 64  # int8-static: four windows, so the search has two folds of two
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


def hf_attention(folder, ids: list[int]) -> list[tuple]:
    """Per layer (q [S, H, D] and k [S, Hkv, D] after RoPE, v [S, Hkv, D], o_proj weight) of one
    sequence starting at position 0, by transformers' own projections and RoPE."""
    import transformers
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    cfg = hf.config
    h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, key=(i, kv): seen.__setitem__(key, out[0].detach()))
             for i, layer in enumerate(hf.model.layers) for kv, m in (("q", layer.self_attn.q_proj),
                                                                       ("k", layer.self_attn.k_proj),
                                                                       ("v", layer.self_attn.v_proj))]
    t = torch.tensor([ids])
    pos = torch.arange(len(ids))[None]
    with torch.no_grad():
        hf(t)
        cos, sin = hf.model.rotary_emb(seen[(0, "k")][None], pos)
    for hook in hooks:
        hook.remove()
    out = []
    for i, layer in enumerate(hf.model.layers):
        q = seen[(i, "q")].view(1, len(ids), h, d).transpose(1, 2)  # [1, H, S, D]
        k = seen[(i, "k")].view(1, len(ids), hkv, d).transpose(1, 2)  # [1, Hkv, S, D]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out.append((q[0].transpose(0, 1), k[0].transpose(0, 1), seen[(i, "v")].view(len(ids), hkv, d),
                    layer.self_attn.o_proj.weight.detach()))
    return out


def calib_ids(folder) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(calib_text(), add_special_tokens=False).ids
    assert len(ids) >= CALIB_TOKENS
    return ids[:CALIB_TOKENS]


@pytest.fixture(scope="session")
def hf_kv(outlier_model):
    """K after RoPE and V of every layer on the calibration ids as one sequence (int4's offsets
    are calibrated in windows of 512, so 256 tokens are one window): [(k, v)] per layer."""
    return [(k, v) for _, k, v, _ in hf_attention(outlier_model, calib_ids(outlier_model))]


@pytest.fixture(scope="session")
def hf_windows(outlier_model):
    """The same per layer, for each STATIC_WINDOW-token window the static calibration runs:
    [window][layer] -> (q, k, v, o_proj weight)."""
    ids = calib_ids(outlier_model)
    return [hf_attention(outlier_model, ids[s: s + STATIC_WINDOW]) for s in range(0, len(ids), STATIC_WINDOW)]


def calibrated(folder, kv: str, calibrate: bool = True):
    """The exporter's torch model for scheme kv, calibrated by the exporter's own calibration step
    on the calibration text (or left as constructed: scales 1.0, offsets 0)."""
    from export.kv_calibration import calibrate as run_calibration
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


def static_calibrated(folder, kv: str):
    """(the exporter's torch model for a static scheme, calibrated by export/calibrate.py on the
    calibration ids in STATIC_WINDOW-token windows, and what the calibration reports)."""
    from export.calibrate import calibrate_static

    m, ref = calibrated(folder, kv, calibrate=False), calibrated(folder, "float", calibrate=False)
    return m, calibrate_static(m, ref, calib_ids(folder), window=STATIC_WINDOW)


def once_per_kv(make, model):
    """kv -> make(model, kv), made the first time it is asked for (the tests read the model and
    the report, never change them)."""
    return functools.cache(lambda kv: make(model, kv))


@pytest.fixture(scope="session")
def static_calibrations(outlier_model):
    """kv -> static_calibrated(outlier_model, kv), once per run."""
    return once_per_kv(static_calibrated, outlier_model)


@pytest.fixture(scope="session")
def int4_calibrations(outlier_model):
    """kv -> calibrated(outlier_model, kv) for an int4 scheme (its key offsets), once per run."""
    return once_per_kv(calibrated, outlier_model)


def hf_absmax(windows, layer: int, skip_first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel absmax [Hkv, D] of K and V over these windows' positions from skip_first on."""
    k = torch.stack([w[layer][1][skip_first:].abs().amax(0) for w in windows]).amax(0)
    v = torch.stack([w[layer][2][skip_first:].abs().amax(0) for w in windows]).amax(0)
    return k, v


@pytest.mark.parametrize("kv", ["int8-static", "int8-tensor"])
def test_static_scales_are_the_chosen_headroom_times_absmax(static_calibrations, hf_windows, kv):
    from export.calibrate import HEADROOM

    m, info = static_calibrations(kv)
    for i, layer in enumerate(m.layers):
        ks, vs = layer.attn.k_scale, layer.attn.v_scale
        hkv, d = hf_windows[0][i][1].shape[1:]
        for s in (ks, vs):  # what GroupQueryAttention takes: PER_CHANNEL [1, Hkv, 1, D], finite, > 0
            assert s.shape == (hkv, d) and bool(torch.isfinite(s).all()) and bool((s > 0).all())
        assert info["k_headroom"][i] in HEADROOM and info["v_headroom"][i] in HEADROOM
        k_abs, _ = hf_absmax(hf_windows, i, 0 if info["k_first_token_counted"][i] else 1)
        _, v_abs = hf_absmax(hf_windows, i, 0)
        if kv == "int8-tensor":  # one value per layer for K and one for V
            k_abs, v_abs = (torch.full_like(a, float(a.max())) for a in (k_abs, v_abs))
        # 1e-3: far inside the 0.8 % between /127 and /128 and the steps between headrooms
        torch.testing.assert_close(ks, info["k_headroom"][i] * k_abs / 127, rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(vs, info["v_headroom"][i] * v_abs / 127, rtol=1e-3, atol=1e-6)


def oracle_error(held, layer: int, k_scale: torch.Tensor, v_scale: torch.Tensor) -> float:
    """Squared error of one layer's attention output after o_proj on the held-out windows' last
    QUERY_ROWS rows, K/V quantized by the numpy reference, attention by hand on transformers' q/k/v."""
    from edgekv.format.kvschemes import quantize_static
    from export.calibrate import QUERY_ROWS

    def attend(q, k, v, wo):  # q [S, H, D], k/v [S, Hkv, D]
        s, h, d = q.shape
        g = h // k.shape[1]
        kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [S, H, D]
        scores = torch.einsum("shd,thd->hst", q.double(), kk.double()) / d ** 0.5
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        out = torch.einsum("hst,thd->shd", scores.softmax(-1), vv.double()).reshape(s, h * d)
        return (out @ wo.double().t())[-QUERY_ROWS:]

    def fake(x, scale):
        return torch.from_numpy(quantize_static(x.numpy(), scale.numpy()).astype("float32")) * scale

    total = 0.0
    for w in held:
        q, k, v, wo = w[layer]
        total += float(((attend(q, fake(k, k_scale), fake(v, v_scale), wo) - attend(q, k, v, wo)) ** 2).sum())
    return total


def test_chosen_headroom_has_the_least_output_error(static_calibrations, hf_windows):
    """The oracle: for each layer, every candidate's error recomputed here (statistics from one
    fold of windows, error on the other, both ways); the calibration's choice must be the least
    (V first with K at its absmax, then K, first token counted or not, with the chosen V)."""
    from export.calibrate import HEADROOM

    _, info = static_calibrations("int8-static")
    folds = [(hf_windows[0::2], hf_windows[1::2]), (hf_windows[1::2], hf_windows[0::2])]
    for i in range(len(hf_windows[0])):
        def err(ak, av, k_sink=True):
            total = 0.0
            for stats, held in folds:
                k_abs, _ = hf_absmax(stats, i, 0 if k_sink else 1)
                _, v_abs = hf_absmax(stats, i, 0)
                total += oracle_error(held, i, ak * k_abs / 127, av * v_abs / 127)
            return total

        errs_v = {a: err(1.0, a) for a in HEADROOM}
        av = info["v_headroom"][i]
        assert errs_v[av] <= min(errs_v.values()) * (1 + 1e-4), (i, av, errs_v)
        errs_k = {(a, s): err(a, av, s) for a in HEADROOM for s in (True, False)}
        if not info["k_first_token_counted"][i]:
            assert errs_k[(info["k_headroom"][i], False)] < errs_k[(info["k_headroom"][i], True)]
        chosen = (info["k_headroom"][i], info["k_first_token_counted"][i])
        assert errs_k[chosen] <= min(errs_k.values()) * (1 + 1e-4), (i, chosen, errs_k)
        assert max(errs_v.values()) > 2 * min(errs_v.values())  # the candidates differ: a choice was made


def test_first_token_left_out_of_key_statistics_when_asked():
    """The first token of a window (an attention sink) can carry keys far from the rest; left out,
    it does not set the scale."""
    from export.calibrate import LayerWindow, channel_absmax

    k = torch.ones(8, 1, 2, 4)
    k[0, 0, 1, 2] = 100.0  # the sink's outlier
    w = LayerWindow((), k, -2 * k, torch.zeros(1))
    k_all, v_all = channel_absmax([w], 0)
    k_rest, v_rest = channel_absmax([w], 1)
    assert float(k_all[1, 2]) == 100.0 and float(v_all[1, 2]) == 200.0
    torch.testing.assert_close(k_rest, torch.ones(2, 4))
    torch.testing.assert_close(v_rest, torch.full((2, 4), 2.0))


@pytest.mark.parametrize("kv", ["int4", "int4-norot"])
def test_int4_key_offsets_are_channel_means_after_rope_and_rotation(int4_calibrations, hf_kv, kv):
    m = int4_calibrations(kv)
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
def test_calibration_beats_no_calibration(outlier_model, static_calibrations, int4_calibrations, kv, margin):
    cal_model = static_calibrations(kv)[0] if kv == "int8-static" else int4_calibrations(kv)
    cal = kld_vs_float(outlier_model, cal_model)
    raw = kld_vs_float(outlier_model, calibrated(outlier_model, kv, calibrate=False))
    assert cal < margin * raw, (cal, raw)


# The real model, at a size CI affords: calibration on the exporter's default text (4,096 tokens
# of stdlib docstrings), scored on REAL_WINDOWS windows of 1024 tokens of pydoc_data.topics (text
# the calibration never saw, edgekv eval's default), the second half of each, as eval does.
# Measured in a torch simulation (docs/kv-schemes.md, 2 windows each of pydoc topics and IDLE's
# NEWS.txt): mean KLD vs the float cache: per-token int8 8.8e-4 / 5.4e-4, absmax static
# 7.4e-3 / 5.6e-3 (8-10x per-token), absmax x1.5 1.4e-3 / 1.1e-3, no clipping at all (absmax of
# the eval text itself) 8.6e-4 / 5.5e-4. The bound, 3x the per-token cache's KLD on the same
# windows, holds the searched scales near the no-clipping floor with margin for window-to-window
# spread, and fails the absmax scales by a factor of ~3. One window is scored (the text and model
# are fixed, so the outcome is too): on it, measured with this calibration, static / per-token
# KLD 1.32 (the second window 1.27), absmax scales 9.8 (7.7e-3 vs 7.9e-4).
REAL_WINDOWS = 1
REAL_BOUND = 3.0


@pytest.mark.slow
def test_real_model_static_kv_close_to_per_token_on_unseen_text():
    from edgekv.tools.corpus import default_text
    from export.kv_calibration import calibration_ids
    from export.recipes import resolve_source
    from export.calibrate import calibrate_static
    from export.model import Transformer

    src, _ = resolve_source(None)

    ref, per_token, static = (Transformer.loaded(src.config, src.state_dict, kv).eval()
                              for kv in ("float", "int8", "int8-static"))
    calibrate_static(static, ref, calibration_ids(src, None, 4096)[0])
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(src.tokenizer_json).encode(default_text()[0], add_special_tokens=False).ids
    kld = {"int8": 0.0, "int8-static": 0.0}
    for w in range(REAL_WINDOWS):
        win = ids[w * 1025: w * 1025 + 1024]

        def logp(m):
            with torch.no_grad():
                out = m(torch.tensor([win]), torch.arange(1024)[None], causal_mask(0, 1024),
                        torch.arange(512, 1024)[None], *m.past_like(0, 1))[0][0]
            return torch.log_softmax(out.double(), -1)

        p = logp(ref)
        for name, m in (("int8", per_token), ("int8-static", static)):
            kld[name] += float((p.exp() * (p - logp(m))).sum(-1).mean()) / REAL_WINDOWS
    assert kld["int8-static"] < REAL_BOUND * kld["int8"], kld
