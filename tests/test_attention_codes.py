"""Attention on the int8 codes (scales applied to the scores / probabilities, or folded into q and
the output) computes what attention on the dequantized cache computes (export/model.py)."""
import numpy as np
import pytest
import torch

from export.model import Transformer, causal_mask
from export.model_config import ModelConfig


def tiny_model(kv: str) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(arch="llama", vocab_size=97, hidden_size=64, intermediate_size=96, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=16)
    m = Transformer(cfg, kv).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
        for layer in m.layers:  # static schemes: calibrated-looking per-channel scales
            if layer.attn.static_scales:
                layer.attn.k_scale.uniform_(0.01, 0.05)
                layer.attn.v_scale.uniform_(0.01, 0.05)
    return m


def run(m: Transformer, ids: list[int], split: int, factored: bool):
    """Prefill ids[:split], then decode the rest one token at a time; every step's logits."""
    for layer in m.layers:
        layer.attn.factored = factored
    out, past = [], m.past_like(0, 1)
    with torch.no_grad():
        for lo, hi in [(0, split)] + [(i, i + 1) for i in range(split, len(ids))]:
            s, p = hi - lo, past[0].shape[0]
            res = m(torch.tensor([ids[lo:hi]]), torch.arange(lo, hi)[None], causal_mask(p, s),
                    torch.tensor([[s - 1]]), *past)
            out.append(res[0][0, -1].numpy())
            past = [torch.cat([a, b], 0) for a, b in zip(past, res[1:])]
    return np.stack(out), past


@pytest.mark.parametrize("kv", ["int8", "int8-static", "int8-tensor"])
def test_attention_on_codes_equals_attention_on_the_dequantized_cache(kv):
    m = tiny_model(kv)
    ids = list(np.random.default_rng(1).integers(0, 97, 24))
    got, got_past = run(m, ids, 10, factored=True)
    want, want_past = run(m, ids, 10, factored=False)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    # the cache itself: the same codes (a rare rounding flip moves one code by one step)
    for a, b in zip(got_past, want_past):
        assert np.abs(a.float().numpy() - b.float().numpy()).max() <= 1.0
    assert np.abs(got[1:] - got[:-1]).max() > 1e-2  # the logits do move from step to step
