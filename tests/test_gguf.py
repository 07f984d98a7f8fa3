"""GGUF loading: a tiny GGUF written here from a random HF checkpoint (with llama.cpp's q/k row
permutation) must load to the same weights and logits; the real GGUF's tokenizer must encode
like transformers' own GGUF tokenizer conversion."""
import json

import numpy as np
import pytest
import torch

from export.loaders import load_gguf, load_hf_folder
from export.model import Transformer, causal_mask
from tests.conftest import make_hf_folder


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # as llama.cpp's convert_hf_to_gguf.py does
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder, path, arch="llama", quant=None, encode=None):
    """quant: a function GGUF tensor name -> GGMLQuantizationType (or None for float32). encode:
    (name, float weight [N, K], type) -> the tensor's blocks [N, bytes per row]; default the gguf
    package's own quantizer (it has none for the K-quants: tests/test_gguf_kquants.py writes
    random valid blocks)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    w = load_file(str(next(folder.glob("*.safetensors"))))
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(cfg["num_attention_heads"])
    wr.add_head_count_kv(cfg["num_key_value_heads"])
    wr.add_rope_freq_base(cfg["rope_theta"] if "rope_theta" in cfg else cfg["rope_parameters"]["rope_theta"])
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    special = {t["content"] for t in tok["added_tokens"]}
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("gpt-2")
    wr.add_token_list(tokens)
    wr.add_token_types([3 if t in special else 1 for t in tokens])
    wr.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_chat_template("{{ messages[0]['content'] }}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
           "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
           "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
           "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
           "mlp.down_proj.weight": "ffn_down.weight"}
    for k, v in w.items():
        if k in names:
            name = names[k]
        else:
            i, rest = k.split(".", 3)[2], k.split(".", 3)[3]
            name = f"blk.{i}.{per[rest]}"
        if name.endswith("attn_q.weight"):
            v = _permute(v, cfg["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            v = _permute(v, cfg["num_key_value_heads"])
        qtype = quant(name) if quant and v.ndim == 2 else None
        if qtype is None:
            wr.add_tensor(name, np.ascontiguousarray(v, np.float32))
        else:  # the gguf package's own quantizer, as llama.cpp's convert writes blocks
            v = np.ascontiguousarray(v, np.float32)
            wr.add_tensor(name, encode(name, v, qtype) if encode else gguf.quants.quantize(v, qtype), raw_dtype=qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def test_gguf_loads_same_model_as_hf_folder(tmp_path):
    folder = make_hf_folder(tmp_path / "hf", "llama")
    write_gguf(folder, tmp_path / "tiny.gguf")
    a, b = load_hf_folder(folder), load_gguf(tmp_path / "tiny.gguf")
    assert a.config.n_heads == b.config.n_heads and a.config.head_dim == b.config.head_dim
    assert set(a.state_dict) == set(b.state_dict)
    for k in a.state_dict:
        torch.testing.assert_close(a.state_dict[k], b.state_dict[k], msg=k)
    ids = torch.randint(0, a.config.vocab_size, (1, 12))
    outs = []
    for src in (a, b):
        m = Transformer(src.config).eval()
        m.load_state_dict(src.state_dict, strict=False)
        with torch.no_grad():
            outs.append(m(ids, torch.arange(12)[None], causal_mask(0, 12), torch.tensor([[11]]),
                          *m.past_like(0, 1))[0])
    torch.testing.assert_close(outs[0], outs[1])
    # the tokenizer rebuilt from GGUF metadata encodes like the original tokenizer.json
    from tokenizers import Tokenizer

    orig = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rebuilt = Tokenizer.from_str(b.tokenizer_json)
    for text in ["The capital of France is Paris.", "naïve 東京 🙂 <|im_start|>user\nhi<|im_end|>"]:
        assert rebuilt.encode(text).ids == orig.encode(text).ids


def test_corrupt_gguf_refused(tmp_path):
    from export.loaders import SourceError

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(SourceError, match="not a readable GGUF"):
        load_gguf(bad)


@pytest.mark.slow
def test_real_gguf_tokenizer_matches_transformers():
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from export.bundle import DEFAULT_RECIPE, MODELS_DIR, recipe_path

    path = recipe_path(json.loads((MODELS_DIR / f"{DEFAULT_RECIPE}.json").read_text()) | {"name": DEFAULT_RECIPE})
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    import gguf

    from export.loaders import gguf_tokenizer_json

    r = gguf.GGUFReader(str(path))
    field = lambda k, d=None: r.fields[k].contents() if k in r.fields else d  # noqa: E731
    ours = Tokenizer.from_str(gguf_tokenizer_json(field, field("tokenizer.ggml.tokens")))
    for text in ["What is the capital of France?", "Numbers 12345 and 3.14159, emoji 🙂, 東京, naïve café\n\n  x\tf()",
                 "<|im_start|>user\nhi<|im_end|>\n", "I'm sure they'll say   spaces   matter.\r\n"]:
        assert ours.encode(text, add_special_tokens=False).ids == hf.encode(text, add_special_tokens=False)
