"""Activation-aware scales (export/awq.py). Oracles: the float model itself (scaling a matrix's
inputs and folding the inverse where they come from is an identity before quantization), and
the calibration error the search minimizes (never above the plain clip search's)."""
import numpy as np
import pytest
import torch

from export import awq
from export.loaders import load_hf_folder
from export.model import Transformer, causal_mask


def logits(model, ids):
    s = len(ids)
    with torch.no_grad():
        out = model(torch.tensor([ids]), torch.arange(s)[None], causal_mask(0, s), torch.arange(s)[None],
                    *model.past_like(0, 1))
    return out[0][0].numpy()


@pytest.mark.parametrize("folder", ["tiny_llama", "tiny_qwen"])  # conftest's: Qwen2 has biases, tied embeddings
def test_folded_scales_leave_the_float_model_unchanged(folder, request, monkeypatch):
    """Every scaled matrix with arbitrary scales, unquantized: same logits as the source (q|k|v
    with Qwen2's bias, gate|up through the RMSNorm weights, down through the up rows)."""
    src = load_hf_folder(request.getfixturevalue(folder))
    ref = Transformer(src.config, "float").eval()
    ref.load_state_dict(src.state_dict, strict=False)
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 300, 40)]
    stats = awq.activation_stats(ref, ids, window=16, rows=8)
    assert len(stats) == 3 * src.config.n_layers and all(x.shape[0] == 3 * 8 for _, x in stats.values())
    rng = np.random.default_rng(1)
    def fake_scale(w, a, x, g, s):
        scale = rng.uniform(0.3, 3.0, w.shape[1]).astype(np.float32)
        return scale, 0.5, awq.int4_groups(w * scale, g, s), 1.0, 0.5

    monkeypatch.setattr(awq, "best_scale", fake_scale)
    state = {n: v.float().numpy() for n, v in src.state_dict.items() if v.dim() == 2}
    params = dict(ref.named_parameters())
    norms = {n: params[n].detach().numpy() for n in params if n.endswith("_norm.weight")}
    state2, norms2, quant, report = awq.apply_awq(state, norms, stats, src.config.intermediate_size, 32, True)
    assert set(report) == set(stats)
    for name in stats:  # every matrix and every norm it folds into really changed
        assert not np.allclose(state2[name], state[name])
    assert all(not np.allclose(norms2[n], norms[n]) for n in norms if n.startswith("layers."))
    for name, q in quant.items():  # the stored codes and scales are those of the scaled, folded matrix
        redo = awq.int4_groups(state2[name], 32, True).dequantize()
        assert np.mean(~np.isclose(q.dequantize(), redo, rtol=1e-5, atol=1e-7)) < 1e-3, name
    scaled = Transformer(src.config, "float").eval()
    scaled.load_state_dict(src.state_dict, strict=False)
    with torch.no_grad():
        p = dict(scaled.named_parameters())
        for n, w in {**state2, **norms2}.items():
            if n in p:
                p[n].copy_(torch.from_numpy(np.asarray(w, np.float32)))
    want = logits(ref, ids)
    np.testing.assert_allclose(logits(scaled, ids), want, atol=1e-4 * np.abs(want).max(), rtol=0)


def test_search_never_worse_than_no_scaling_and_a_skewed_channel_is_scaled():
    """alpha = 0 is a candidate, so the chosen error is at most the clip search's alone; with one
    input channel 30x louder than the rest, scaling it pays and is chosen."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    x[:, 5] *= 30.0
    s, alpha, q, err0, err = awq.best_scale(w, np.abs(x).mean(0), x, 32, True)
    assert alpha > 0 and err < 0.9 * err0 and s[5] == s.max()
    np.testing.assert_allclose(((x @ (q.dequantize() / s).T - x @ w.T) ** 2).sum(), err, rtol=1e-3)  # its error
    flat = rng.standard_normal((256, 64)).astype(np.float32)
    s, alpha, q, err0, err = awq.best_scale(w, np.abs(flat).mean(0), flat, 32, True)
    assert err <= err0


def test_output_weighted_clip_beats_the_weights_own_error():
    """A clip ratio chosen per group by its share of the output error (the inputs' Gram matrix)
    gives a lower output error than one chosen by the weights' own squared error."""
    from export.weights import int4_groups

    rng = np.random.default_rng(2)
    w = rng.standard_normal((96, 64)).astype(np.float32)
    x = rng.standard_normal((512, 64)).astype(np.float32) * rng.uniform(0.1, 5.0, 64).astype(np.float32)
    xg = x.reshape(len(x), 2, 32)
    gram = np.einsum("rgi,rgj->gij", xg, xg)
    err = lambda q: float(((x @ (q.dequantize() - w).T) ** 2).sum())  # noqa: E731
    assert err(int4_groups(w, 32, True, gram)) < 0.95 * err(int4_groups(w, 32, True))
