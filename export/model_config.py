"""What the exporter knows of a checkpoint's architecture: the supported and refused ones, the
per-family facts their configs leave out (FAMILIES), ModelConfig (read from a Hugging Face
config.json by `from_hf_dict`, or built by the GGUF loader) and the RoPE tables it implies."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                           "SmolLM3ForCausalLM": "smollm3", "Phi3ForCausalLM": "phi3", "Gemma3ForCausalLM": "gemma3"}
# architectures people have that are close to a supported one, and why they are refused
REFUSED_ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "Qwen3-MoE (mixture-of-experts layers) is not supported; dense Qwen3 is",
    "Qwen2MoeForCausalLM": "Qwen2-MoE (mixture-of-experts layers) is not supported; dense Qwen2/2.5 is",
    "Gemma3ForConditionalGeneration": "Gemma 3 with its vision tower is not supported; the text-only models "
                                      "(gemma3_text: Gemma3ForCausalLM, e.g. 270M, 1B) are",
    "Phi3VForCausalLM": "Phi-3 vision is not supported; the text models (Phi3ForCausalLM) are",
    "Phi4MMForCausalLM": "Phi-4-multimodal is not supported; Phi-4-mini (Phi3ForCausalLM) is",
    "PhiMoEForCausalLM": "Phi-3.5-MoE is not supported; Phi-3.5-mini (Phi3ForCausalLM) is",
    "Gemma2ForCausalLM": "Gemma 2 (attention logit soft-capping) is not supported; Gemma 3 text is",
}
ROPE_TYPES = ("default", "llama3", "linear", "longrope")

# per architecture, what its config does not say itself
FAMILIES = {
    "llama": {},
    "qwen2": {"attention_bias": True},  # Qwen2 always has q/k/v biases
    "qwen3": {"qk_norm": True},
    "smollm3": {},
    "phi3": {},
    "gemma3": {"qk_norm": True, "post_norms": True, "norm_offset": 1.0, "hidden_act": "gelu_tanh",
               "embed_scale": True},
}


class UnsupportedModel(ValueError):
    pass


@dataclass
class ModelConfig:
    arch: str  # a SUPPORTED_ARCHITECTURES value
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # llama3 / linear / longrope parameters (None: plain RoPE)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2 always has them)
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    # llama.cpp's rope_freqs: each frequency divided by its factor (Llama-3 scaling as a GGUF holds it)
    rope_freq_factors: list[float] | None = None
    rotary_dim: int | None = None  # the leading dims of each head that rotate (partial rotary); None: all
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (SmolLM3's NoPE layers)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # RMSNorm on attention's and the MLP's outputs before the residual (Gemma 3)
    hidden_act: str = "silu"  # the gate's activation: silu (SwiGLU) | gelu_tanh (GeGLU)
    embed_scale: float = 1.0  # embeddings multiplied by it (Gemma 3: sqrt(hidden))
    query_scale: float | None = None  # attention's score scale; None: 1/sqrt(head_dim)
    sliding_window: int | None = None  # local layers see the last `sliding_window` positions
    local_layers: tuple[int, ...] = ()  # Gemma 3's sliding-window layers
    rope_local_theta: float | None = None  # their RoPE base

    @classmethod
    def from_hf_dict(cls, c: dict) -> "ModelConfig":
        archs = c.get("architectures") or []
        refused = next((REFUSED_ARCHITECTURES[a] for a in archs if a in REFUSED_ARCHITECTURES), None)
        if refused:
            raise UnsupportedModel(refused)
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModel(
                f"unsupported architecture {archs or c.get('model_type')!r}; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES) + " (Llama family incl. SmolLM2, TinyLlama, Llama-3.x; Qwen2/2.5; "
                "Qwen3 dense; SmolLM3; Phi-3.5/Phi-4-mini; Gemma 3 text)")
        fam = FAMILIES[arch]
        n_heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // n_heads  # honour an explicit head_dim
        n_layers = c["num_hidden_layers"]
        layer_types = list(c.get("layer_types") or ["full_attention"] * n_layers)
        local = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
        _refuse_unsupported(c, arch, local)
        rope, theta = _rope(c, "full_attention" if arch == "gemma3" else None)
        local_theta = _rope(c, "sliding_attention")[1] if arch == "gemma3" else None
        if arch == "gemma3" and local_theta is None:
            local_theta = float(c.get("rope_local_base_freq", 10000.0))
        prf = c.get("partial_rotary_factor") or (c.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0
        rotary = int(head_dim * prf)
        if rotary % 2 or rotary <= 0:
            raise UnsupportedModel(f"partial_rotary_factor {prf}: {rotary} rotary dims of {head_dim} is not a positive even number")
        if rope and rope["rope_type"] == "longrope":
            rope = _longrope(rope, c, rotary)
        nope = ()
        if arch == "smollm3":  # no_rope_layers[i] = 1: layer i uses RoPE (transformers' SmolLM3Config)
            flags = c.get("no_rope_layers") or [int((i + 1) % c.get("no_rope_layer_interval", 4) != 0)
                                                for i in range(n_layers)]
            nope = tuple(i for i in range(n_layers) if not flags[i])
        eos = c.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        qpas = c.get("query_pre_attn_scalar")
        return cls(
            arch=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            rope_theta=10000.0 if theta is None else theta,
            rope_scaling=rope,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", arch in ("gemma3", "smollm3"))),
            attention_bias=fam.get("attention_bias", False) or bool(c.get("attention_bias", False)),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            bos_token_id=c.get("bos_token_id"),
            eos_token_id=eos,
            rotary_dim=None if rotary == head_dim else rotary,
            nope_layers=nope,
            qk_norm=fam.get("qk_norm", False),
            post_norms=fam.get("post_norms", False),
            hidden_act=fam.get("hidden_act", "silu"),
            embed_scale=math.sqrt(c["hidden_size"]) if fam.get("embed_scale") else 1.0,
            query_scale=None if qpas is None or qpas == head_dim else qpas ** -0.5,
            sliding_window=c.get("sliding_window") if local else None,
            local_layers=local,
            rope_local_theta=local_theta,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads(Path(path).read_text()))

    def for_context(self, max_context: int) -> "ModelConfig":
        """This config for a bundle of `max_context` positions. LongRoPE has two factor sets; a
        cache needs one for every position (a key cached with one set and read by a query rotated
        with the other would be wrong), so a bundle takes the short factors when its context
        fits the original one and the long ones beyond, as llama.cpp does for its n_ctx
        (docs/models.md)."""
        rs = self.rope_scaling
        if not rs or rs["rope_type"] != "longrope":
            return self
        long = max_context > rs["original_max_position_embeddings"]
        return replace(self, rope_freq_factors=list(rs["long_factor" if long else "short_factor"]))


def _refuse_unsupported(c: dict, arch: str, local: tuple) -> None:
    """One line for what the checkpoint's config asks that the graph does not do."""
    if c.get("final_logit_softcapping") or c.get("attn_logit_softcapping"):
        raise UnsupportedModel(f"{arch}: logit soft-capping is not supported")
    if c.get("mlp_bias"):
        raise UnsupportedModel(f"{arch}: MLP biases are not supported")
    act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
    want = "gelu_pytorch_tanh" if arch == "gemma3" else "silu"
    if act != want:
        raise UnsupportedModel(f"{arch}: activation {act!r} is not supported ({want} is)")
    if arch != "gemma3" and c.get("use_sliding_window", arch == "phi3" and c.get("sliding_window")):
        window = c.get("sliding_window")
        if window and window < c.get("max_position_embeddings", 0):  # a window past every position is no window
            raise UnsupportedModel(f"{arch}: sliding-window attention (window {window}) is not supported")
    if arch == "gemma3" and local and not c.get("sliding_window"):
        raise UnsupportedModel("gemma3: sliding-window layers without a sliding_window size")


def _rope(c: dict, layer_type: str | None) -> tuple[dict | None, float | None]:
    """(scaling parameters with rope_type, or None for plain RoPE; the base) from either config
    form: transformers 5's rope_parameters (per layer type for Gemma 3) or rope_theta + rope_scaling."""
    rp = c.get("rope_parameters") or {}
    if layer_type and isinstance(rp.get(layer_type), dict):
        rp = rp[layer_type]
    rs = dict(c.get("rope_scaling") or rp or {})
    theta = (rp.get("rope_theta") if layer_type else None) or c.get("rope_theta") or rs.get("rope_theta")
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "su":  # Phi-3's early name for LongRoPE
        kind = "longrope"
    if kind not in (None, *ROPE_TYPES):
        raise UnsupportedModel(f"unsupported rope scaling {kind!r}; supported: none, {', '.join(ROPE_TYPES[1:])}")
    theta = None if theta is None else float(theta)
    if kind in (None, "default") or (kind == "linear" and float(rs.get("factor", 1.0)) == 1.0):
        return None, theta
    rs = {k: v for k, v in rs.items() if k not in ("type", "rope_theta", "partial_rotary_factor")}
    rs["rope_type"] = kind
    return rs, theta


def _longrope(rs: dict, c: dict, rotary: int) -> dict:
    """LongRoPE's parameters complete: the original context and the attention factor (cos and
    sin are scaled by it), as transformers computes them when the config leaves them out."""
    orig = rs.get("original_max_position_embeddings") or c.get("original_max_position_embeddings")
    if not orig:
        raise UnsupportedModel("longrope scaling without original_max_position_embeddings")
    for k in ("short_factor", "long_factor"):
        if len(rs.get(k) or []) != rotary // 2:
            raise UnsupportedModel(f"longrope {k}: {len(rs.get(k) or [])} factors, {rotary // 2} rotary frequencies")
    factor = rs.get("factor") or c.get("max_position_embeddings", orig) / orig
    af = rs.get("attention_factor")
    if af is None:
        af = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return {"rope_type": "longrope", "short_factor": list(rs["short_factor"]), "long_factor": list(rs["long_factor"]),
            "original_max_position_embeddings": int(orig), "attention_factor": float(af)}


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """[rotary_dim / 2] rotation rates; `local`: Gemma 3's sliding-window layers (their own base,
    no scaling)."""
    d = cfg.rotary_dim or cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # [D/2]
    rs = None if local else cfg.rope_scaling
    if cfg.rope_freq_factors is not None and not local:  # llama.cpp's rope_freqs / LongRoPE's chosen set
        return (inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)).float()
    if rs and rs["rope_type"] == "linear":
        return (inv / rs["factor"]).float()
    if rs and rs["rope_type"] == "longrope":  # the short factors unless for_context chose the long ones
        return (inv / torch.tensor(rs["short_factor"], dtype=torch.float64)).float()
    if rs:  # llama3: stretch low frequencies, keep high ones, blend in between
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def rope_attention_factor(cfg: ModelConfig) -> float:
    rs = cfg.rope_scaling
    return float(rs.get("attention_factor", 1.0)) if rs and rs["rope_type"] == "longrope" else 1.0
