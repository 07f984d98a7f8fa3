"""The decoder, in plain torch: the Llama family (SmolLM2, TinyLlama, Llama-3.x), Qwen2/2.5, Qwen3
(dense), SmolLM3, Phi-3.5/Phi-4-mini and Gemma 3 text (docs/models.md: what each needs and what
is verified).

One forward serves prefill and decode and always takes a past (possibly empty). It is the
graph contract of docs/graph.md written as torch:

  forward(input_ids [B,S], position_ids [B,S], key_mask bool [B,S,P+S], logits_index [B,K],
          *past)  ->  (logits [B,K,V], *present)

(a model with sliding-window layers, Gemma 3, also takes local_key_mask bool [B,S,P+S], the mask
of those layers: LocalMaskGraph makes it the graph's fifth input)

`past`/`present` are per layer the tensors of the KV scheme (kv_store/kv_load in export/kv_torch.py,
edgekv/format/kvschemes.py), slot-major [P,B,Hkv,D]. Only the S new tokens' K/V come out. The new
K/V go through quantize -> dequantize before attention, so a token sees exactly what later
steps will read back from the cache (chunking then does not change results).

What differs between the architectures is data on ModelConfig (a per-head q/k norm, which
layers skip RoPE, how much of a head rotates, norms after attention and MLP, ...), read from the
checkpoint's config by `from_hf_dict` through the FAMILIES table (export/model_config.py); the
modules below only look at those fields.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from edgekv.format.kvschemes import get_scheme, hadamard
from export.kv_torch import FACTORED_KINDS, _torch_dtype, attend, attend_codes, kv_load, kv_store
from export.model_config import ModelConfig, rope_attention_factor, rope_inv_freq


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
            out = attend(qg, G, k_all, v_all, allowed)  # [B, Hkv, G*S, D]
        if scheme.rotate:
            out = out @ self.had.t()
        out = out.view(B, Hkv, G, S, D).permute(0, 3, 1, 2, 4).reshape(B, S, H * D)
        return self.wo(out), present_k + present_v


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
