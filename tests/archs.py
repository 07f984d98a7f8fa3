"""Tiny random checkpoints of each supported architecture, with the config options of the real
models (Llama 3.2's llama3 rope scaling and tied embeddings, Qwen2.5's biases, Qwen3's explicit
head_dim and q/k norms, SmolLM3's NoPE layers, Phi-4-mini's partial rotary and LongRoPE, Gemma
3's local/global layers), written by transformers itself; and the same weights as a GGUF in
llama.cpp's layout (its own HF -> GGUF tensor name map, metadata keys and convert conventions:
q/k rows permuted for the Llama-derived models, Llama-3 scaling as a rope_freqs tensor, LongRoPE
as rope_factors_long/short, Gemma norms stored as 1 + w)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tests.conftest import CHAT_TEMPLATE, TINY_VOCAB, tiny_tokenizer_json

COMMON = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

# each family's chat format, as its own template writes it (the shape, not the whole template)
TEMPLATES = {
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "chatml": CHAT_TEMPLATE,
    # Qwen3's: earlier assistant turns lose their <think> part, and enable_thinking=false
    # pre-fills an empty one (the model's own default is thinking on)
    "qwen3": ("{%- for m in messages %}"
              "{%- if m['role'] == 'assistant' %}{%- set content = m['content'] %}"
              "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
              "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
              "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
              "{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
              "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
              "{%- endif %}{%- endif %}"),
    # SmolLM3's: a system line says /think or /no_think (enable_thinking, default on)
    "smollm3": ("{%- set think = '/no_think' if (enable_thinking is defined and not enable_thinking) else '/think' %}"
                "{{- '<|im_start|>system\\n' + think + '<|im_end|>\\n' }}"
                "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"),
    "phi3": ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"),
    "gemma3": ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
               "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"),
}

# name -> (transformers config class, model class, config overrides, chat template)
ARCHS = {
    "llama3.2": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        rope_theta=500000.0, tie_word_embeddings=True, head_dim=16), "llama3"),
    "qwen2.5": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0, tie_word_embeddings=True), "chatml"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, rope_theta=1000000.0, tie_word_embeddings=True),
              "qwen3"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4, rope_theta=5000000.0,
                                                            tie_word_embeddings=True), "smollm3"),
    # Phi-4-mini: 3/4 of each head rotates, LongRoPE (6 = 12 rotary dims / 2 factors per set)
    "phi4-mini": ("Phi3Config", "Phi3ForCausalLM", dict(
        partial_rotary_factor=0.75, tie_word_embeddings=True, max_position_embeddings=256,
        original_max_position_embeddings=64, sliding_window=262144,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                      "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0]}), "phi3"),
    # Phi-3.5-mini: every dim rotates, its own head
    "phi3.5-mini": ("Phi3Config", "Phi3ForCausalLM", dict(
        max_position_embeddings=256, original_max_position_embeddings=64, sliding_window=262144,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.05, 1.2, 1.5, 1.9, 2.4, 3.0, 3.5],
                      "long_factor": [1.0, 1.5, 3.0, 6.0, 10.0, 14.0, 18.0, 20.0]}), "phi3"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], rope_theta=1000000.0,
        rope_local_base_freq=10000.0, tie_word_embeddings=True, num_key_value_heads=1,
        hidden_activation="gelu_pytorch_tanh"), "gemma3"),
}


# two configs with the real models' head shapes at a tiny size, where GroupQueryAttention's CPU
# kernel rotates (head_dim % 16, rotary dims % 16: tests/test_fused_archs.py): Qwen3 (head_dim 128)
# with head_dim 32, Phi-4-mini (96 of 128 dims rotate) with 16 of 32
_Q, _P = ARCHS["qwen3"], ARCHS["phi4-mini"]
VARIANTS = {
    "qwen3-d32": (_Q[0], _Q[1], {**_Q[2], "head_dim": 32}, _Q[3]),
    "phi4-mini-d32": (_P[0], _P[1], {**_P[2], "hidden_size": 128, "partial_rotary_factor": 0.5, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0],
        "long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 12.0, 16.0, 20.0]}}, _P[3]),
}


# the tiny Gemma 3's exports (tests/test_gemma3.py, test_fused_gemma3.py: one bundle per KV
# scheme for both): a parity check of a prompt and this many decode steps, well past its window of 8
GEMMA_PARITY_STEPS = 32


def make_arch_folder(path: Path, name: str) -> Path:
    """ARCHS[name] (or VARIANTS[name]) as a random checkpoint written by transformers (config.json
    + safetensors)."""
    import torch
    import transformers

    cfg_cls, model_cls, overrides, template = {**ARCHS, **VARIANTS}[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**COMMON, **overrides})
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():  # random init is small; widen it so attention is not ~uniform
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
            elif "bias" in pname:
                p.normal_(0, 0.3)
            elif "norm" in pname:  # norms not all 1 (or 0 for Gemma's 1 + w): their weights matter
                p.normal_(0.0 if name == "gemma3" else 1.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(tiny_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATES[template],
                                                            "eos_token": "<|im_end|>"}))
    return path


# --- the same checkpoint as llama.cpp's convert_hf_to_gguf.py would write it -------------------

GGUF_ARCH = {"LlamaForCausalLM": "LLAMA", "Qwen2ForCausalLM": "QWEN2", "Qwen3ForCausalLM": "QWEN3",
             "SmolLM3ForCausalLM": "SMOLLM3", "Phi3ForCausalLM": "PHI3", "Gemma3ForCausalLM": "GEMMA3"}
PERMUTED = ("LLAMA", "SMOLLM3")  # convert's LlamaModel and its subclasses permute q/k rows


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # convert_hf_to_gguf.py's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(rs: dict, theta: float, dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / lo, old / hi
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_arch_gguf(folder: Path, path: Path, quant=None, encode=None, chat_template: str | None = None) -> Path:
    """The tests' one tiny-GGUF writer. quant: a function GGUF tensor name -> GGMLQuantizationType
    (or None for float32) for the 2-D tensors. encode: (name, float weight [N, K], type) -> the
    tensor's blocks [N, bytes per row]; default the gguf package's own quantizer (it has none for
    the K-quants: tests/test_gguf_kquants.py writes random valid blocks). chat_template: the
    GGUF's (default the folder's)."""
    import gguf
    from safetensors.numpy import load_file

    c = json.loads((folder / "config.json").read_text())
    arch = gguf.MODEL_ARCH[GGUF_ARCH[c["architectures"][0]]]
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    tok = json.loads((folder / "tokenizer.json").read_text())
    n_layers, n_head, n_kv = c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // n_head
    rp = c.get("rope_parameters") or {}
    rp = rp.get("full_attention", rp)  # Gemma 3's are per layer type: the global layers' base is the file's
    theta = rp.get("rope_theta") or c.get("rope_theta")
    wr = gguf.GGUFWriter(str(path), arch_name)
    wr.add_block_count(n_layers)
    wr.add_context_length(c["max_position_embeddings"])
    wr.add_embedding_length(c["hidden_size"])
    wr.add_feed_forward_length(c["intermediate_size"])
    wr.add_head_count(n_head)
    wr.add_head_count_kv(n_kv)
    wr.add_key_length(head_dim)
    wr.add_value_length(head_dim)
    wr.add_rope_freq_base(theta)
    wr.add_layer_norm_rms_eps(c["rms_norm_eps"])
    extra = {}
    if arch == gguf.MODEL_ARCH.LLAMA and rp.get("rope_type") == "llama3":
        extra[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"] = _llama3_rope_factors(rp, theta, head_dim)
    if arch == gguf.MODEL_ARCH.PHI3:  # Phi3MiniModel.set_gguf_parameters / generate_extra_tensors
        prf = rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
        rope_dims = int(prf * c["hidden_size"]) // n_head
        orig = rp.get("original_max_position_embeddings") or c["original_max_position_embeddings"]
        scale = c["max_position_embeddings"] / orig
        wr.add_rope_dimension_count(rope_dims)
        wr.add_rope_scaling_orig_ctx_len(orig)
        wr.add_sliding_window(c.get("sliding_window") or 0)
        wr.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
        extra[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight"] = np.array(rp["long_factor"], np.float32)
        extra[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight"] = np.array(rp["short_factor"], np.float32)
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
    wr.add_chat_template(chat_template or json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])
    tmap = gguf.get_tensor_name_map(arch, n_layers)  # llama.cpp's own HF -> GGUF names
    for k, v in load_file(str(next(folder.glob("*.safetensors")))).items():
        name = tmap.get_name(k, try_suffixes=(".weight", ".bias"))
        assert name is not None, k
        if arch in [gguf.MODEL_ARCH[a] for a in PERMUTED] and name.endswith(("attn_q.weight", "attn_k.weight")):
            v = _permute(v, n_head if "attn_q" in name else n_kv)
        if arch == gguf.MODEL_ARCH.GEMMA3 and name.endswith("norm.weight"):
            v = v + 1  # Gemma3Model.modify_tensors: norms as 1 + w
        v = np.ascontiguousarray(v, np.float32)
        qtype = quant(name) if quant and v.ndim == 2 else None
        if qtype is None:
            wr.add_tensor(name, v)
        else:  # the gguf package's own quantizer, as llama.cpp's convert writes blocks
            wr.add_tensor(name, encode(name, v, qtype) if encode else gguf.quants.quantize(v, qtype), raw_dtype=qtype)
    for name, v in extra.items():
        wr.add_tensor(name, v)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path
