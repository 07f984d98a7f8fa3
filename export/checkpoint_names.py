"""Checkpoint names -> ours: the explicit tables for Hugging Face and GGUF checkpoints (per
architecture), the renaming that fuses q|k|v and gate|up and checks every tensor's presence and
shape against the model, and the way back (unfuse)."""
from __future__ import annotations

import torch

from export.model import Transformer
from export.model_config import FAMILIES, ModelConfig
from export.source import SourceError
from export.weights import concat_rows

# checkpoint name (per layer with {i}) -> our name, or (our name, slot) for parts that are
# concatenated along dim 0 into one fused matrix (q|k|v -> wqkv, gate|up -> w_gate_up)
HF_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": ("layers.{i}.attn.wqkv.weight", 0),
    "model.layers.{i}.self_attn.k_proj.weight": ("layers.{i}.attn.wqkv.weight", 1),
    "model.layers.{i}.self_attn.v_proj.weight": ("layers.{i}.attn.wqkv.weight", 2),
    "model.layers.{i}.self_attn.q_proj.bias": ("layers.{i}.attn.wqkv.bias", 0),
    "model.layers.{i}.self_attn.k_proj.bias": ("layers.{i}.attn.wqkv.bias", 1),
    "model.layers.{i}.self_attn.v_proj.bias": ("layers.{i}.attn.wqkv.bias", 2),
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.wo.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": ("layers.{i}.mlp.w_gate_up.weight", 0),
    "model.layers.{i}.mlp.up_proj.weight": ("layers.{i}.mlp.w_gate_up.weight", 1),
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.w_down.weight",
}

GGUF_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "blk.{i}.attn_q.weight": ("layers.{i}.attn.wqkv.weight", 0),
    "blk.{i}.attn_k.weight": ("layers.{i}.attn.wqkv.weight", 1),
    "blk.{i}.attn_v.weight": ("layers.{i}.attn.wqkv.weight", 2),
    "blk.{i}.attn_q.bias": ("layers.{i}.attn.wqkv.bias", 0),
    "blk.{i}.attn_k.bias": ("layers.{i}.attn.wqkv.bias", 1),
    "blk.{i}.attn_v.bias": ("layers.{i}.attn.wqkv.bias", 2),
    "blk.{i}.attn_output.weight": "layers.{i}.attn.wo.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.mlp_norm.weight",
    "blk.{i}.ffn_gate.weight": ("layers.{i}.mlp.w_gate_up.weight", 0),
    "blk.{i}.ffn_up.weight": ("layers.{i}.mlp.w_gate_up.weight", 1),
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.w_down.weight",
}


# what an architecture's checkpoint names differently from the Llama layout above
HF_EXTRA = {
    "qwen3": {"model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attn.q_norm.weight",
              "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attn.k_norm.weight"},
    "phi3": {"model.layers.{i}.self_attn.qkv_proj.weight": "layers.{i}.attn.wqkv.weight",  # already q|k|v
             "model.layers.{i}.mlp.gate_up_proj.weight": "layers.{i}.mlp.w_gate_up.weight"},  # already gate|up
    "gemma3": {"model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attn.q_norm.weight",
               "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attn.k_norm.weight",
               # Gemma's post_attention_layernorm normalizes attention's output; the MLP's input
               # norm is pre_feedforward_layernorm
               "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attn_norm.weight",
               "model.layers.{i}.pre_feedforward_layernorm.weight": "layers.{i}.mlp_norm.weight",
               "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.post_mlp_norm.weight"},
}
HF_DROP = {"phi3": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}  # parts phi3 holds fused

GGUF_EXTRA = {
    "qwen3": {"blk.{i}.attn_q_norm.weight": "layers.{i}.attn.q_norm.weight",
              "blk.{i}.attn_k_norm.weight": "layers.{i}.attn.k_norm.weight"},
    "phi3": {"blk.{i}.attn_qkv.weight": "layers.{i}.attn.wqkv.weight",
             "blk.{i}.ffn_up.weight": "layers.{i}.mlp.w_gate_up.weight"},  # llama.cpp keeps gate|up fused as ffn_up
}


def hf_names(arch: str) -> dict:
    table = {k: v for k, v in HF_NAMES.items() if not any(f".{p}." in k for p in HF_DROP.get(arch, ()))}
    return {**table, **HF_EXTRA.get(arch, {})}


def gguf_names(arch: str) -> dict:
    table = dict(GGUF_NAMES)
    if arch == "phi3":
        table = {k: v for k, v in table.items() if not isinstance(v, tuple)}
    return {**table, **GGUF_EXTRA.get(arch, {})}


def offset_norms(sd: dict[str, torch.Tensor], cfg: ModelConfig, sign: float = 1.0) -> dict[str, torch.Tensor]:
    """Gemma stores RMSNorm weights as w for (1 + w): ours hold 1 + w (as llama.cpp's GGUF does),
    so the graph's norm is the same Mul for every architecture (and AWQ's folds stay valid)."""
    offset = FAMILIES[cfg.arch].get("norm_offset", 0.0)
    if not offset:
        return sd
    return {k: v + sign * offset if k.endswith("norm.weight") else v for k, v in sd.items()}



def _expand(table: dict, n_layers: int) -> dict:
    out = {}
    for src, dst in table.items():
        if "{i}" in src:
            for i in range(n_layers):
                out[src.format(i=i)] = (dst[0].format(i=i), dst[1]) if isinstance(dst, tuple) else dst.format(i=i)
        else:
            out[src] = dst
    return out


def rename(weights: dict[str, torch.Tensor], table: dict[str, str], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map checkpoint names to ours; refuse unknown or missing tensors and wrong shapes."""
    names = _expand(table, cfg.n_layers)
    unknown = [k for k in weights if k not in names and not k.endswith("rotary_emb.inv_freq")]
    if unknown:
        raise SourceError(f"unexpected tensors in checkpoint: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    sd, parts = {}, {}
    for k, v in weights.items():
        if k not in names:
            continue
        dst = names[k]
        if isinstance(dst, tuple):
            parts.setdefault(dst[0], {})[dst[1]] = v
        else:
            sd[dst] = v
    for dst, slots in parts.items():
        if sorted(slots) != list(range(len(slots))) or len(slots) not in (2, 3):
            raise SourceError(f"checkpoint has only parts {sorted(slots)} of {dst}")
        sd[dst] = torch.cat([slots[j] for j in sorted(slots)], 0)
    expected = _expected_shapes(cfg)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in sd]
    if missing:
        raise SourceError(f"checkpoint lacks tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for k, shape in expected.items():
        if tuple(sd[k].shape) != shape:
            raise SourceError(f"tensor {k}: shape {tuple(sd[k].shape)}, config says {shape}")
    assert len(sd) == len(expected), (len(sd), len(expected))
    return sd


def rename_blocks(blocks: dict, table: dict, cfg: ModelConfig) -> dict:
    """The source's quantized blocks under our names; a fused matrix keeps its blocks only if
    every part has them in the same format."""
    names = _expand(table, cfg.n_layers)
    out, parts = {}, {}
    for k, q in blocks.items():
        dst = names.get(k)
        if isinstance(dst, tuple):
            parts.setdefault(dst[0], {})[dst[1]] = q
        elif dst is not None:
            out[dst] = q
    for dst, slots in parts.items():
        n_parts = 3 if dst.endswith("wqkv.weight") else 2
        if sorted(slots) == list(range(n_parts)):
            try:
                out[dst] = concat_rows([slots[j] for j in range(n_parts)])
            except ValueError:
                pass
    return out


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    with torch.device("meta"):
        m = Transformer(cfg)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()
            if not (cfg.tie_word_embeddings and k == "lm_head.weight")}


def unfuse(sd: dict[str, torch.Tensor], cfg: ModelConfig, table: dict | None = None) -> dict[str, torch.Tensor]:
    """Our state dict back to checkpoint names (fused matrices split again; table: the
    architecture's Hugging Face names by default)."""
    if table is None:
        table = hf_names(cfg.arch)
        sd = offset_norms(sd, cfg, -1.0)
    sizes = {"wqkv": [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim],
             "w_gate_up": [cfg.intermediate_size, cfg.intermediate_size]}
    out = {}
    for src, dst in _expand(table, cfg.n_layers).items():
        if isinstance(dst, tuple):
            name, slot = dst
            if name not in sd:
                continue
            key = name.split(".")[-2]
            out[src] = torch.split(sd[name], sizes[key], 0)[slot]
        elif dst in sd:
            out[src] = sd[dst]
    return out
