"""The decoder, in plain torch: the Llama family (SmolLM2, TinyLlama, Llama-3.x), Qwen2/2.5, Qwen3
(dense), SmolLM3, Phi-3.5/Phi-4-mini and Gemma 3 text (docs/models.md: what each needs and what
is verified).

One forward serves prefill and decode and always takes a past (possibly empty). It is the
graph contract of docs/graph.md written as torch:

  forward(input_ids [B,S], position_ids [B,S], key_mask bool [B,S,P+S], logits_index [B,K],
          *past)  ->  (logits [B,K,V], *present)

(a model with sliding-window layers, Gemma 3, also takes local_key_mask bool [B,S,P+S], the mask
of those layers: LocalMaskGraph makes it the graph's fifth input)

`past`/`present` are per layer the tensors of the KV scheme (see kv_store/kv_load below and
edgekv/format/kvschemes.py), slot-major [P,B,Hkv,D]. Only the S new tokens' K/V come out. The new
K/V go through quantize -> dequantize before attention, so a token sees exactly what later
steps will read back from the cache (chunking then does not change results).

What differs between the architectures is data on ModelConfig (a per-head q/k norm, which
layers skip RoPE, how much of a head rotates, norms after attention and MLP, ...), read from the
checkpoint's config by `from_hf_dict` through the FAMILIES table; the modules below only look
at those fields.
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from edgekv.format.kvschemes import INT4_LEVELS, INT4_THRESHOLDS, get_scheme, hadamard, int4_byte_table, n_groups

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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * normalized(x, self.eps)


def normalized(x, eps):
    """x / sqrt(mean(x^2) + eps): the form onnxruntime fuses into one normalization kernel
    (rsqrt exports as Sqrt, Reciprocal, Mul, which it does not)."""
    xf = x.float()
    xf = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype)


def rotate_half_matrix(d: int, rotary: int | None = None) -> torch.Tensor:
    """R with x @ R == cat(-x[r/2:r], x[:r/2], 0...) (HF's rotate_half on the first r = rotary
    dims, zero on the rest: partial rotary): one MatMul in the graph instead of Slice, Slice,
    Neg, Concat per tensor."""
    h = (rotary or d) // 2
    r = torch.zeros(d, d)
    r[torch.arange(h) + h, torch.arange(h)] = -1.0
    r[torch.arange(h), torch.arange(h) + h] = 1.0
    return r


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, static_scales: bool = False, center_keys: bool = False):
        super().__init__()
        self.cfg = cfg
        self.observer = None  # calibration: a callable fed (k, v) after RoPE; None when exporting
        self.static_scales = static_scales
        if static_scales:  # int8-static / int8-tensor: calibrated constants, baked into the graph
            self.register_buffer("k_scale", torch.ones(cfg.n_kv_heads, cfg.head_dim))
            self.register_buffer("v_scale", torch.ones(cfg.n_kv_heads, cfg.head_dim))
        if center_keys:  # int4: calibrated mean key per channel, subtracted before quantizing
            self.register_buffer("k_offset", torch.zeros(cfg.n_kv_heads, cfg.head_dim))
        self.register_buffer("had", torch.from_numpy(hadamard(cfg.head_dim)), persistent=False)
        # attention on the int8 codes for the kinds that allow it (attend_codes); False runs the
        # generic path on dequantized K/V, which tests hold attend_codes to
        self.factored = True
        h, hkv, d, e = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_size
        # q, k, v projections fused into one matrix (rows: q, then k, then v): one MatMul per layer
        self.wqkv = nn.Linear(e, (h + 2 * hkv) * d, bias=cfg.attention_bias)
        self.wo = nn.Linear(h * d, e, bias=False)
        if cfg.qk_norm:  # per-head RMSNorm over D, q's weight for q's heads, k's for k's
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        # q * query_scale * sqrt(D): the score scale the model asks for through attention's 1/sqrt(D)
        self.q_gain = None if cfg.query_scale is None else cfg.query_scale * math.sqrt(d)

    def scales(self):
        """(key scale, value scale): a static scheme's calibrated constants, else (None, None)."""
        return (self.k_scale, self.v_scale) if self.static_scales else (None, None)

    def norm_qk(self, qk):
        """qk [S, B, H+Hkv, D]: each head normalized over D, q heads by q_norm, k heads by k_norm."""
        cfg = self.cfg
        w = torch.cat([self.q_norm.weight.expand(cfg.n_heads, -1), self.k_norm.weight.expand(cfg.n_kv_heads, -1)])
        return w * normalized(qk, cfg.rms_norm_eps)  # w [H+Hkv, D]

    def forward(self, x, cos, sin, rot, allowed, past, scheme):
        cfg = self.cfg
        B, S, _ = x.shape
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        G = H // Hkv
        # slot-major from the start: one Transpose per layer instead of one per K, V and their scales
        qkv = self.wqkv(x).view(B, S, H + 2 * Hkv, D).transpose(0, 1)  # [S, B, H+2Hkv, D]
        qk, v = torch.split(qkv, [H + Hkv, Hkv], dim=2)  # [S, B, H+Hkv, D], [S, B, Hkv, D]
        if cfg.qk_norm:
            qk = self.norm_qk(qk)
        if cos is not None:  # None: a layer without RoPE (NoPE)
            qk = qk * cos + torch.matmul(qk, rot) * sin  # RoPE on q and k at once; cos, sin [S, B, 1, D]
        q, k = torch.split(qk, [H, Hkv], dim=2)  # keys cached after RoPE
        if self.q_gain is not None:
            q = q * self.q_gain
        if scheme.rotate:  # (qR)(kR)^T = qk^T; v is rotated back after attention
            q, k, v = q @ self.had, k @ self.had, v @ self.had

        k_new, v_new = k, v  # [S, B, Hkv, D] slot-major
        if self.observer is not None:
            self.observer(k_new, v_new)
        if scheme.center_keys:
            # q.(k - m) = q.k - q.m: the same shift for every key a query sees, and softmax ignores
            # a shift, so the offset is never added back. It takes the keys' large per-channel
            # mean out of the int4 range, leaving the levels for what varies.
            k_new = k_new - self.k_offset.to(x.dtype)
        ks, vs = self.scales()
        # Group the G query heads that share a KV head: no repeat of K/V is materialized.
        qg = q.reshape(S, B, Hkv, G, D).permute(1, 2, 3, 0, 4).reshape(B, Hkv, G * S, D)
        if self.factored and scheme.kind in FACTORED_KINDS:
            out, present_k, present_v = attend_codes(qg, G, k_new, v_new, past, allowed, scheme, ks, vs)
        else:
            present_k, k_hat = kv_store(scheme, k_new, ks)
            present_v, v_hat = kv_store(scheme, v_new, vs)
            k_all = torch.cat([kv_load(scheme, past[0], x.dtype, ks), k_hat], 0)  # [P+S, B, Hkv, D]
            v_all = torch.cat([kv_load(scheme, past[1], x.dtype, vs), v_hat], 0)
            scores = torch.matmul(qg, k_all.permute(1, 2, 3, 0)) * (1.0 / math.sqrt(D))  # [B, Hkv, G*S, T]
            probs = masked_softmax(scores, allowed, G)
            out = torch.matmul(probs, v_all.permute(1, 2, 0, 3))  # [B, Hkv, G*S, D]
        if scheme.rotate:
            out = out @ self.had.t()
        out = out.view(B, Hkv, G, S, D).permute(0, 3, 1, 2, 4).reshape(B, S, H * D)
        return self.wo(out), present_k + present_v


# kinds whose attention runs on the int8 codes, their scales applied outside the cache (attend_codes)
FACTORED_KINDS = ("dynamic", "static")


def masked_softmax(scores, allowed, G):
    """scores [B, Hkv, G*S, T] -> probabilities, keys outside `allowed` [B, S, T] at exactly 0."""
    B, Hkv, GS, _ = scores.shape
    s = scores.view(B, Hkv, G, GS // G, -1)
    s = torch.where(allowed[:, None, None], s, torch.finfo(s.dtype).min)
    return torch.softmax(s.float(), dim=-1).to(scores.dtype).view(B, Hkv, GS, -1)


def attend_codes(qg, G, k_new, v_new, past, allowed, scheme, ks, vs):
    """Attention on the int8 codes. The scales factor out of both products, so they scale the
    [G*S, T] scores and probabilities (a scale per key and head: scores = (q.k_int) s_k,
    out = (p s_v).v_int) or q and the output (constant per-channel scales) instead of a float
    copy of the whole [T, D] cache; past and new keys are multiplied separately, so the cache
    is not concatenated either.

    The cache stays slot-major: [T, B, Hkv, D] is read as [T, B*Hkv*D] (a free reshape) and one
    MatMul serves every head, the queries laid out block-diagonally (row block h: head h's
    queries in column block h, zeros elsewhere), the values' products taken back off the
    diagonal blocks. A per-head [Hkv, D, T] view would need a Transpose of the whole cache per
    layer per step; the block-diagonal form pays B*Hkv x the attention products' multiply-adds
    instead: little for decode (a few query rows), visible in prefill (docs/benchmarks.md). Returns (out [B, Hkv, G*S, D], present K tensors, present V)."""
    B, Hkv, M, D = qg.shape  # M = G*S query rows per KV head
    H = B * Hkv
    present_k, kc_new, sk_new = kv_quantize(scheme, k_new, ks)
    present_v, vc_new, sv_new = kv_quantize(scheme, v_new, vs)
    kc_past, sk_past = kv_codes(scheme, past[0], qg.dtype, ks)
    vc_past, sv_past = kv_codes(scheme, past[1], qg.dtype, vs)
    per_key = scheme.kind == "dynamic"
    if per_key:
        # q.(k_int * s_k) = (q . k_int) * s_k per key. The 1/127 taken into q and given back with
        # the scale keeps q . k_int (codes up to 127) as small as the true scores, inside fp16
        qg = qg * (1.0 / (127.0 * math.sqrt(D)))
    else:  # q.(k_int * s_k) = (q * s_k).k_int, per channel
        qg = qg * (ks.to(qg.dtype) * (1.0 / math.sqrt(D)))[None, :, None, :]
    r = torch.arange(H)
    eye = (r[:, None] == r[None, :]).to(qg.dtype)[:, None, :, None]  # [H, 1, H, 1]
    qbd = (qg.reshape(H, M, 1, D) * eye).reshape(H * M, H * D)  # block-diagonal queries

    def flat(c):  # [T, B, Hkv, D] -> [T, B*Hkv*D], no copy
        return c.reshape(-1, H * D)

    # P from the key mask [B, S, P+S], the one input every layer shares, not from this layer's
    # past: the graph's shape arithmetic is then the same in every layer and computed once
    P = allowed.shape[-1] - kc_new.shape[0]
    scores = torch.cat([torch.matmul(qbd, flat(kc_past).t()), torch.matmul(qbd, flat(kc_new).t())], -1)
    scores = scores.reshape(B, Hkv, M, -1)  # [B, Hkv, G*S, T]
    if per_key:
        scores = scores * (torch.cat([sk_past, sk_new], 0).permute(1, 2, 0)[:, :, None] * 127.0)  # [B, Hkv, 1, T]
    probs = masked_softmax(scores, allowed, G)
    if per_key:  # sum_t p_t s_v[t] v_int[t]: the 127 again keeps p * s_v clear of fp16's subnormals
        probs = probs * (torch.cat([sv_past, sv_new], 0).permute(1, 2, 0)[:, :, None] * 127.0)
    probs = probs.reshape(H * M, -1)
    out = (torch.matmul(probs[:, :P], flat(vc_past))
           + torch.matmul(probs[:, P:], flat(vc_new)))  # [H*M, H*D]: head h's rows x every head's values
    out = (out.reshape(H, M, H, D) * eye).sum(2).reshape(B, Hkv, M, D)  # the diagonal blocks
    # per key: undo the 127; per channel: sum_t p_t v_int[t] * s_v = (p . v_int) * s_v
    out = out * (1.0 / 127.0) if per_key else out * vs.to(qg.dtype)[None, :, None, :]
    return out, present_k, present_v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gelu = cfg.hidden_act == "gelu_tanh"  # GeGLU (Gemma 3), else SwiGLU
        # gate and up fused (rows: gate, then up): one MatMul instead of two
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gu = self.w_gate_up(x)
        gate = gu[..., : self.inter]
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w_down(act * gu[..., self.inter:])


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, static_scales: bool = False, center_keys: bool = False):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, static_scales, center_keys)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if cfg.post_norms:  # Gemma 3: each sublayer's output normalized before the residual add
            self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norms = cfg.post_norms

    def forward(self, x, cos, sin, rot, allowed, past, scheme):
        a, present = self.attn(self.attn_norm(x), cos, sin, rot, allowed, past, scheme)
        if self.post_norms:
            a = self.post_attn_norm(a)
        x = x + a
        m = self.mlp(self.mlp_norm(x))
        if self.post_norms:
            m = self.post_mlp_norm(m)
        return x + m, present


@contextlib.contextmanager
def _zeroed_init():
    """torch's Linear and Embedding initialize themselves through these three functions."""
    saved = {n: getattr(nn.init, n) for n in ("kaiming_uniform_", "uniform_", "normal_")}
    for n in saved:
        setattr(nn.init, n, lambda t, *a, **k: nn.init.zeros_(t))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_scheme: str = "float"):
        super().__init__()
        self.cfg = cfg
        self.scheme = get_scheme(kv_scheme)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        static = self.scheme.kind == "static"
        self.layers = nn.ModuleList(Block(cfg, static, self.scheme.center_keys) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if cfg.local_layers:
            self.register_buffer("inv_freq_local", rope_inv_freq(cfg, local=True), persistent=False)
        self.register_buffer("rot", rotate_half_matrix(cfg.head_dim, cfg.rotary_dim), persistent=False)
        # each layer's RoPE table: None (NoPE), "global" or "local" (Gemma 3's sliding-window layers)
        self.layer_rope = [None if i in cfg.nope_layers else "local" if i in cfg.local_layers else "global"
                           for i in range(cfg.n_layers)]

    @classmethod
    def loaded(cls, cfg: ModelConfig, state_dict: dict, kv_scheme: str = "float") -> "Transformer":
        """A model holding `state_dict` (strict=False: inv_freq is computed, lm_head may be tied),
        built with its Linear and Embedding weights zeroed instead of drawn at random: they are
        overwritten at once, and drawing them cost ~0.8 s a model of 135M (an export builds four
        or five)."""
        with _zeroed_init():
            m = cls(cfg, kv_scheme)
        m.load_state_dict(state_dict, strict=False)
        return m

    def with_layers(self, keep: list[int]) -> "Transformer":
        """A view of this model with only the layers `keep` (the same modules, renumbered 0..):
        what the exporter traces before stamping each layer's copies (export/stamp.py)."""
        view = Transformer.__new__(Transformer)
        nn.Module.__init__(view)
        c = self.cfg
        view.cfg = replace(c, n_layers=len(keep), nope_layers=tuple(j for j, i in enumerate(keep) if i in c.nope_layers),
                           local_layers=tuple(j for j, i in enumerate(keep) if i in c.local_layers))
        view.scheme, view.layer_rope = self.scheme, [self.layer_rope[i] for i in keep]
        for name, module in self.named_children():
            setattr(view, name, nn.ModuleList(self.layers[i] for i in keep) if name == "layers" else module)
        kept = self.state_dict(keep_vars=True).keys()  # the persistent buffers' names among them
        for name, buf in self.named_buffers(recurse=False):
            view.register_buffer(name, buf, persistent=name in kept)
        return view

    def rope_tables(self, position_ids, inv_freq, dtype):
        """cos, sin [S, B, 1, D] for positions [B, S]: the layers work slot-major, every head
        rotated alike. Partial rotary: the dims past rotary_dim get cos 1, sin 0 (rate 0)."""
        cfg = self.cfg
        pad = cfg.head_dim - (cfg.rotary_dim or cfg.head_dim)
        if pad:  # one rate per dim: the rotating halves', then 0 for the dims that stay
            emb = position_ids.float()[..., None] * torch.cat([inv_freq, inv_freq, torch.zeros(pad)])  # [B, S, D]
        else:
            freqs = position_ids.float()[..., None] * inv_freq  # [B, S, D/2]
            emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos(), emb.sin()  # [B, S, D]
        af = rope_attention_factor(cfg)
        if af != 1.0:  # LongRoPE's attention factor, on the rotating dims only
            amp = torch.cat([torch.full((cfg.head_dim - pad,), af), torch.ones(pad)])
            cos, sin = cos * amp, sin * af
        return tuple(t.to(dtype).transpose(0, 1)[:, :, None] for t in (cos, sin))

    def forward(self, input_ids, position_ids, key_mask, logits_index, *past, local_key_mask=None,
                key_positions=None, local_key_positions=None):
        """The sliding-window layers' mask, first of: local_key_mask [B, S, P+S] given whole (the
        graph's input, docs/graph.md: the runtime builds it from each key cell's position);
        local_key_positions [B, P_local+S], the positions of the local layers' own shorter past
        (a windowed cache, torch only: their past tensors hold P_local slots); key_positions
        [B, P+S], the position of each key slot, windowed and and-ed with key_mask; by default a
        linear past: its P slots hold the P positions just before the first new token."""
        n = len(self.scheme.tensors)  # tensors per layer for K, and again for V
        assert len(past) == 2 * n * self.cfg.n_layers, (len(past), n)
        x = self.embed(input_ids)  # [B, S, E]
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        tables = {"global": self.rope_tables(position_ids, self.inv_freq, x.dtype), None: (None, None)}
        # which keys each new token sees, causal rule included, comes whole from the runtime: a
        # batch may mix tokens of several sequences over one pool of cells (docs/graph.md)
        allowed = {"global": key_mask, None: key_mask}  # [B, S, P+S]
        if self.cfg.local_layers:
            tables["local"] = self.rope_tables(position_ids, self.inv_freq_local, x.dtype)
            if local_key_mask is not None:
                allowed["local"] = local_key_mask
            elif local_key_positions is not None:
                allowed["local"] = self.window_mask(position_ids, local_key_positions, own=True)
            else:
                if key_positions is None:
                    key_positions = linear_key_positions(position_ids, key_mask.shape[2])
                allowed["local"] = key_mask & self.window_mask(position_ids, key_positions)
        rot = self.rot.to(x.dtype)
        presents = []
        for i, layer in enumerate(self.layers):
            p = past[2 * n * i: 2 * n * (i + 1)]
            kind = self.layer_rope[i]
            cos, sin = tables[kind]
            mask = allowed["local" if i in self.cfg.local_layers else "global"]
            x, pres = layer(x, cos, sin, rot, mask, (p[:n], p[n:]), self.scheme)
            presents.extend(pres)
        idx = logits_index[..., None].expand(-1, -1, x.shape[-1])  # [B, K, E]
        x = torch.gather(x, 1, idx)  # final norm + head only on the rows asked for
        logits = self.lm_head(self.norm(x)).float()  # [B, K, V]
        return (logits, *presents)

    def window_mask(self, position_ids, key_positions, own: bool = False):
        """[B, S, P+S]: key j within the sliding window of query i (q_pos - k_pos < window);
        own: a windowed cache's slots, which hold nothing later than the query (0 <= q - k)."""
        d = position_ids[:, :, None] - key_positions[:, None, :]  # [B, S, T]
        return ((d >= 0) if own else True) & (d < self.cfg.sliding_window)

    def past_like(self, slots: int, batch: int, dtype=torch.float32):
        cfg = self.cfg
        out = []
        for _ in range(cfg.n_layers):
            for _kv in range(2):
                for spec in self.scheme.tensors:
                    shape = spec.shape(slots, batch, cfg.n_kv_heads, cfg.head_dim)
                    out.append(torch.zeros(shape, dtype=_torch_dtype(spec.dtype, dtype)))
        return out


def linear_key_positions(position_ids, total: int):
    """[B, total]: the key positions of a linear past (its total - S slots hold the positions just
    before the first new token's) followed by the new tokens' own."""
    s = position_ids.shape[1]
    past = position_ids[:, :1] - (total - s) + torch.arange(total - s)[None]  # [B, P]
    return torch.cat([past, position_ids], 1)


class LocalMaskGraph(nn.Module):
    """The graph of a model with local layers: local_key_mask is a fifth input, before the past
    (docs/graph.md), so that torch.export sees it as a positional argument."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model
        self.cfg, self.scheme = model.cfg, model.scheme

    def forward(self, input_ids, position_ids, key_mask, logits_index, local_key_mask, *past):
        return self.model(input_ids, position_ids, key_mask, logits_index, *past, local_key_mask=local_key_mask)


def causal_mask(p: int, s: int, batch: int = 1) -> torch.Tensor:
    """key_mask [batch, s, p + s] of one sequence: every past key, and the new block causally."""
    return torch.cat([torch.ones(s, p, dtype=torch.bool), torch.ones(s, s, dtype=torch.bool).tril()], 1).expand(
        batch, s, p + s)


def _torch_dtype(name: str, float_dtype):
    return {"int8": torch.int8, "uint8": torch.uint8, "float16": torch.float16, "float": float_dtype}[name]


# --- KV schemes in torch. The formats are defined in edgekv/format/kvschemes.py (shared with the
# runtime and the numpy reference); these two functions are the only torch code that knows them,
# and they tell schemes apart by kind.

def kv_quantize(scheme, x, static_scale=None):
    """int8 kinds: x [S,B,Hkv,D] float -> (tensors to store, codes as floats, scale): a reader
    sees codes * scale, the scale [S,B,Hkv] per (token, head) (dynamic) or the constant [Hkv,D]."""
    if scheme.kind == "static":  # constant scale [Hkv, D] (per channel, or one value repeated)
        s = static_scale.to(x.dtype)
        q = torch.clamp(torch.round(x / s), -127.0, 127.0)
        return [q.to(torch.int8)], q, s
    if scheme.kind == "dynamic":
        # one fp16 scale per (token, head): absmax / 127, floored so an all-zero row stays finite
        scale = (x.abs().amax(-1).float() / 127.0).clamp(min=scheme.min_scale).to(torch.float16)  # [S,B,Hkv]
        s = scale.to(x.dtype)
        q = torch.clamp(torch.round(x / s[..., None]), -127.0, 127.0)
        return [q.to(torch.int8), scale], q, s
    raise NotImplementedError(scheme.kind)


def kv_codes(scheme, tensors, dtype, static_scale=None):
    """int8 kinds: stored tensors -> (codes as floats, scale), the counterpart of kv_quantize."""
    if scheme.kind == "static":
        return tensors[0].to(dtype), static_scale.to(dtype)
    if scheme.kind == "dynamic":
        return tensors[0].to(dtype), tensors[1].to(dtype)
    raise NotImplementedError(scheme.kind)


def kv_store(scheme, x, static_scale=None):
    """x [S,B,Hkv,D] float -> (tensors to store, x_hat: what a reader of the cache will see)."""
    if scheme.kind == "float":
        return [x], x
    if scheme.kind == "static":
        stored, q, s = kv_quantize(scheme, x, static_scale)
        return stored, q * s
    if scheme.kind == "dynamic":
        stored, q, s = kv_quantize(scheme, x, static_scale)
        return stored, q * s[..., None]
    if scheme.kind == "packed4":
        S, B, Hkv, D = x.shape
        g = n_groups(D)
        xg = x.reshape(S, B, Hkv, g, D // g)
        scale = xg.abs().amax(-1).float().clamp(min=scheme.min_scale).to(torch.float16)  # [S,B,Hkv,G] absmax = level 1
        y = xg / scale.to(x.dtype)[..., None]
        # nearest level: count the midpoints below (comparisons, no bitwise or argmin ops for TensorRT)
        codes = (y[..., None] > torch.tensor(INT4_THRESHOLDS, dtype=x.dtype)).to(x.dtype).sum(-1)  # [S,B,Hkv,G,D/G] 0..15
        levels = torch.tensor(INT4_LEVELS, dtype=x.dtype)
        x_hat = (levels[codes.long()] * scale.to(x.dtype)[..., None]).reshape(S, B, Hkv, D)
        c = codes.reshape(S, B, Hkv, D // 2, 2)
        packed = c[..., 0] + 16.0 * c[..., 1]  # [S,B,Hkv,D/2] two codes per byte, arithmetically
        return [packed.to(torch.uint8), scale], x_hat
    raise NotImplementedError(scheme.kind)


def kv_load(scheme, tensors, dtype, static_scale=None):
    if scheme.kind == "float":
        return tensors[0]
    if scheme.kind == "static":
        return tensors[0].to(dtype) * static_scale.to(dtype)
    if scheme.kind == "packed4":
        packed, scale = tensors
        P, B, Hkv, D2 = packed.shape
        g = scale.shape[-1]
        # one Gather decodes both nibbles of every byte: [256, 2] table of levels
        table = torch.from_numpy(int4_byte_table()).to(dtype)
        v = table[packed.to(dtype).long()]  # [P,B,Hkv,D/2,2]
        return (v.reshape(P, B, Hkv, g, 2 * D2 // g) * scale.to(dtype)[..., None]).reshape(P, B, Hkv, 2 * D2)
    if scheme.kind == "dynamic":
        q, scale = tensors
        return q.to(dtype) * scale.to(dtype)[..., None]
    raise NotImplementedError(scheme.kind)
