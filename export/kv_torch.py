"""The KV schemes in torch (the formats are defined in edgekv/format/kvschemes.py, shared with the
runtime and the numpy reference): storing and reading a layer's K/V, and attention on the int8
codes with their scales applied outside the cache (attend_codes)."""
from __future__ import annotations

import math

import torch

from edgekv.format.kvschemes import INT4_LEVELS, INT4_THRESHOLDS, int4_byte_table, n_groups

# kinds whose attention runs on the int8 codes, their scales applied outside the cache (attend_codes)
FACTORED_KINDS = ("dynamic", "static")


def masked_softmax(scores, allowed, G):
    """scores [B, Hkv, G*S, T] -> probabilities, keys outside `allowed` [B, S, T] at exactly 0."""
    B, Hkv, GS, _ = scores.shape
    s = scores.view(B, Hkv, G, GS // G, -1)
    s = torch.where(allowed[:, None, None], s, torch.finfo(s.dtype).min)
    return torch.softmax(s.float(), dim=-1).to(scores.dtype).view(B, Hkv, GS, -1)


# torch >= 2.7 says when torch.export is tracing; without it (2.6) the written form always runs
_EXPORTING = getattr(torch.compiler, "is_exporting", None)


def attend(qg, G, k_all, v_all, allowed):
    """softmax(q.k / sqrt(D)) v: qg [B, Hkv, G*S, D] (a KV head's G query heads stacked), k_all and
    v_all [T, B, Hkv, D], allowed [B, S, T] -> [B, Hkv, G*S, D]. The exported graph gets the
    MatMul/Softmax form (what the graph passes and TensorRT's rules match); eager float32 runs
    torch's fused kernel, which never materializes the [G*S, T] scores: the calibration's float
    passes over 1,024-token windows take about half the time (docs/benchmarks.md, stop 48). A row that sees no
    key at all (padding) keeps the written form's uniform weights."""
    if _EXPORTING is None or _EXPORTING() or qg.dtype != torch.float32 or not bool(allowed.any(-1).all()):
        scores = torch.matmul(qg, k_all.permute(1, 2, 3, 0)) * (1.0 / math.sqrt(qg.shape[-1]))
        return torch.matmul(masked_softmax(scores, allowed, G), v_all.permute(1, 2, 0, 3))
    B, Hkv, GS, _ = qg.shape
    mask = allowed[:, None, None].expand(B, 1, G, GS // G, -1).reshape(B, 1, GS, -1)
    return torch.nn.functional.scaled_dot_product_attention(
        qg, k_all.permute(1, 2, 0, 3), v_all.permute(1, 2, 0, 3), attn_mask=mask)


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
