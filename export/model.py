"""The decoder, in plain torch: Llama family (SmolLM2, TinyLlama, Llama-3.x) and Qwen2/2.5.

One forward serves prefill and decode and always takes a past (possibly empty). It is the
graph contract of docs/graph.md written as torch:

  forward(input_ids [B,S], position_ids [B,S], key_mask bool [B,S,P+S], logits_index [B,K],
          *past)  ->  (logits [B,K,V], *present)

`past`/`present` are per layer the tensors of the KV scheme (see kv_store/kv_load below and
edgekv/format/kvschemes.py), slot-major [P,B,Hkv,D]. Only the S new tokens' K/V come out. The new
K/V go through quantize -> dequantize before attention, so a token sees exactly what later
steps will read back from the cache (chunking then does not change results).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from edgekv.format.kvschemes import INT4_LEVELS, INT4_THRESHOLDS, get_scheme, hadamard, int4_byte_table, n_groups

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


class UnsupportedModel(ValueError):
    pass


@dataclass
class ModelConfig:
    arch: str  # "llama" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2 always has them)
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @classmethod
    def from_hf_dict(cls, c: dict) -> "ModelConfig":
        archs = c.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModel(
                f"unsupported architecture {archs or c.get('model_type')!r}; supported: "
                + ", ".join(SUPPORTED_ARCHITECTURES) + " (Llama family incl. SmolLM2, TinyLlama, Llama-3.x; Qwen2/2.5)")
        n_heads = c["num_attention_heads"]
        rope = c.get("rope_scaling") or c.get("rope_parameters") or None
        theta = c.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        if rope and rope.get("rope_type", rope.get("type")) in (None, "default"):
            rope = None
        if rope and rope.get("rope_type", rope.get("type")) != "llama3":
            raise UnsupportedModel(f"unsupported rope scaling {rope!r}; supported: none, llama3")
        eos = c.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            arch=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            n_layers=c["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,  # honour an explicit head_dim
            rms_norm_eps=c.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=rope,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            bos_token_id=c.get("bos_token_id"),
            eos_token_id=eos,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        return cls.from_hf_dict(json.loads(Path(path).read_text()))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # [D/2]
    rs = cfg.rope_scaling
    if rs:  # llama3: stretch low frequencies, keep high ones, blend in between
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        # x / sqrt(mean(x^2) + eps): the form onnxruntime fuses into one normalization kernel
        # (rsqrt exports as Sqrt, Reciprocal, Mul, which it does not)
        xf = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half_matrix(d: int) -> torch.Tensor:
    """R with x @ R == cat(-x[d/2:], x[:d/2]) (HF's rotate_half): one MatMul in the graph instead
    of Slice, Slice, Neg, Concat per tensor."""
    h = d // 2
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

    def scales(self):
        """(key scale, value scale): a static scheme's calibrated constants, else (None, None)."""
        return (self.k_scale, self.v_scale) if self.static_scales else (None, None)

    def forward(self, x, cos, sin, rot, allowed, past, scheme):
        cfg = self.cfg
        B, S, _ = x.shape
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        G = H // Hkv
        # slot-major from the start: one Transpose per layer instead of one per K, V and their scales
        qkv = self.wqkv(x).view(B, S, H + 2 * Hkv, D).transpose(0, 1)  # [S, B, H+2Hkv, D]
        qk, v = torch.split(qkv, [H + Hkv, Hkv], dim=2)  # [S, B, H+Hkv, D], [S, B, Hkv, D]
        qk = qk * cos + torch.matmul(qk, rot) * sin  # RoPE on q and k at once; cos, sin [S, B, 1, D]
        q, k = torch.split(qk, [H, Hkv], dim=2)  # keys cached after RoPE
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
        # gate and up fused (rows: gate, then up): one MatMul instead of two
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gu = self.w_gate_up(x)
        return self.w_down(F.silu(gu[..., : self.inter]) * gu[..., self.inter:])


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, static_scales: bool = False, center_keys: bool = False):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, static_scales, center_keys)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, rot, allowed, past, scheme):
        a, present = self.attn(self.attn_norm(x), cos, sin, rot, allowed, past, scheme)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), present


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
        self.register_buffer("rot", rotate_half_matrix(cfg.head_dim), persistent=False)

    def forward(self, input_ids, position_ids, key_mask, logits_index, *past):
        n = len(self.scheme.tensors)  # tensors per layer for K, and again for V
        assert len(past) == 2 * n * self.cfg.n_layers, (len(past), n)
        x = self.embed(input_ids)  # [B, S, E]
        freqs = position_ids.float()[..., None] * self.inv_freq  # [B, S, D/2]
        emb = torch.cat([freqs, freqs], -1)
        # [S, B, 1, D]: the layers work slot-major, every head rotated alike
        cos, sin = (t.to(x.dtype).transpose(0, 1)[:, :, None] for t in (emb.cos(), emb.sin()))
        # which keys each new token sees, causal rule included, comes whole from the runtime: a
        # batch may mix tokens of several sequences over one pool of cells (docs/graph.md)
        allowed = key_mask  # [B, S, P+S]
        presents = []
        for i, layer in enumerate(self.layers):
            p = past[2 * n * i: 2 * n * (i + 1)]
            x, pres = layer(x, cos, sin, self.rot.to(x.dtype), allowed, (p[:n], p[n:]), self.scheme)
            presents.extend(pres)
        idx = logits_index[..., None].expand(-1, -1, x.shape[-1])  # [B, K, E]
        x = torch.gather(x, 1, idx)  # final norm + head only on the rows asked for
        logits = self.lm_head(self.norm(x)).float()  # [B, K, V]
        return (logits, *presents)

    def past_like(self, slots: int, batch: int, dtype=torch.float32):
        cfg = self.cfg
        out = []
        for _ in range(cfg.n_layers):
            for _kv in range(2):
                for spec in self.scheme.tensors:
                    shape = spec.shape(slots, batch, cfg.n_kv_heads, cfg.head_dim)
                    out.append(torch.zeros(shape, dtype=_torch_dtype(spec.dtype, dtype)))
        return out


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
