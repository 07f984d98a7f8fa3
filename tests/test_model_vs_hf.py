"""Our torch model definition against Hugging Face transformers on tiny random checkpoints."""
import pytest
import torch

from export.loaders import load_hf_folder
from export.model import Transformer, causal_mask
from tests.conftest import make_hf_folder

CASES = {
    "llama": ("llama", {}),
    "llama-gqa-explicit-head-dim": ("llama", {"head_dim": 24, "num_key_value_heads": 1}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope-scaling": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                      "rope_theta": 500000.0}),
    "qwen2-bias": ("qwen2", {"rope_theta": 1000000.0}),
}


@pytest.mark.parametrize("case", CASES)
def test_full_forward_matches_transformers(case, tmp_path):
    import transformers

    arch, overrides = CASES[case]
    folder = make_hf_folder(tmp_path, arch, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    src = load_hf_folder(folder)
    ours = Transformer(src.config, "float")
    ours.load_state_dict(src.state_dict, strict=False)
    ours.eval()
    S = 40  # beyond original_max_position_embeddings / low_freq_factor, so llama3 scaling matters
    ids = torch.randint(0, src.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [S, V]
        out = ours(ids, torch.arange(S)[None], causal_mask(0, S), torch.arange(S)[None],
                   *ours.past_like(0, 1))[0][0]
    assert ref.abs().max() > 0.1  # the model is not degenerate
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)


def test_unsupported_architecture_refused(tmp_path):
    from export.loaders import load_hf_folder
    from export.model_config import UnsupportedModel

    folder = make_hf_folder(tmp_path, "llama")
    cfg = (folder / "config.json").read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel")
    (folder / "config.json").write_text(cfg)
    with pytest.raises(UnsupportedModel, match="supported: LlamaForCausalLM, Qwen2ForCausalLM"):
        load_hf_folder(folder)


def test_fused_weights_split_back_exactly(tmp_path):
    from safetensors.torch import load_file

    from export.checkpoint_names import unfuse

    folder = make_hf_folder(tmp_path, "qwen2")
    original = load_file(str(next(folder.glob("*.safetensors"))))
    src = load_hf_folder(folder)
    back = unfuse(src.state_dict, src.config)
    assert set(back) == set(original)
    for k, v in original.items():
        assert torch.equal(back[k], v.float()), k


def test_loaded_model_holds_the_state_dict_and_zeros_for_what_it_lacks(tmp_path):
    """Transformer.loaded = construct + load_state_dict(strict=False), except that what the state
    dict lacks is zero instead of random; torch's own initialization is back afterwards."""
    src = load_hf_folder(make_hf_folder(tmp_path, "llama"))
    ref = Transformer(src.config, "float")
    ref.load_state_dict(src.state_dict, strict=False)
    got = Transformer.loaded(src.config, src.state_dict)
    for (name, a), (_, b) in zip(ref.state_dict().items(), got.state_dict().items()):
        assert torch.equal(a, b), name
    partial = {k: v for k, v in src.state_dict.items() if k != "layers.0.mlp.w_down.weight"}
    assert not Transformer.loaded(src.config, partial).layers[0].mlp.w_down.weight.any()
    assert torch.nn.Linear(8, 8).weight.abs().sum() > 0  # random again outside
