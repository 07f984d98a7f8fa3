"""Weight quantization at export: each matrix's stored format decided (the source's own blocks
kept, or requantized: AWQ + clip search, clip search, round-to-nearest), the model given exactly
those values, and what storing them costs against the source's own weights."""
from __future__ import annotations

import numpy as np
import torch

from edgekv.errors import ExportError, note
from export.kv_calibration import calibration_ids
from export.source import Source
from export.model import Transformer, causal_mask
from export.weights import plan_weights, stored_bytes, summary


def quantize_model(model: Transformer, src: Source, weights: str, group: int, method: str = "awq",
                   requantize: bool = False, calib: tuple[str | None, int] = (None, 4096)) -> tuple[dict, dict | None]:
    """Decide each weight's stored format and give the model exactly those (dequantized) values
    (and, with AWQ, the RMSNorm weights its scales fold into). Returns the plan and AWQ's report."""
    if weights == "float":
        return {}, None
    state = {k: v.float().numpy() for k, v in src.state_dict.items() if v.dim() == 2}
    if src.config.tie_word_embeddings:  # the head is stored apart from the table (8-bit blocks for the MatMul, the table's own for the Gather)
        state["lm_head.weight"] = state["embed.weight"]
    if weights == "int4":
        note(f"  groups of {group} where requantized")
    try:
        kept = {} if requantize else dict(src.blocks)  # requantize: ignore the source's own blocks (for comparison)
        if src.config.tie_word_embeddings and "embed.weight" in kept:
            kept["lm_head.weight"] = kept["embed.weight"]  # a tied head is the table's own blocks
        awq = None
        if weights == "int4" and method == "awq":
            state, quant, awq = activation_aware(model, src, state, kept, group, calib)
            kept = {**kept, **quant}  # AWQ's own quantization (its clip search), taken as it stands
        plan = plan_weights(state, kept, weights, group, "embed.weight", "lm_head.weight", method != "rtn")
    except ValueError as e:
        raise ExportError(str(e)) from None
    if src.config.tie_word_embeddings:
        model.lm_head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, q in plan.items():
            params[name].copy_(torch.from_numpy(q.dequantize()))
    for origin, r in summary(plan).items():
        note(f"  {r['tensors']:4d} tensors {r['bytes'] / 2**20:7.1f} MiB  {origin}")
    return plan, awq


def activation_aware(model: Transformer, src: Source, state: dict, kept: dict, group: int,
                     calib: tuple[str | None, int]) -> tuple[dict, dict, dict | None]:
    """AWQ (export/awq.py) for the matrices requantized to INT4 (not the source's own blocks);
    the RMSNorm weights its scales fold into are set on `model`. Returns the scaled state, the
    matrices' QuantWeights and a report for the manifest (None when nothing is requantized)."""
    from export.awq import SCALED, activation_stats, apply_awq

    targets = {n for n in state if n not in kept and any(n.endswith(f".{p}.weight") for p in SCALED)}
    # down's scale folds into the up rows: not where gate|up keeps the source's own blocks
    targets -= {n for n in targets if n.endswith(".mlp.w_down.weight")
                and n.replace("w_down", "w_gate_up") not in targets}
    if not targets:
        return state, {}, None
    ids, desc = calibration_ids(src, *calib)
    note(f"  activation-aware scales (AWQ) for {len(targets)} matrices on {len(ids)} tokens of {desc[:40]}...")
    ref = Transformer.loaded(model.cfg, src.state_dict).eval()
    stats = {n: v for n, v in activation_stats(ref, ids).items() if n in targets}
    params = dict(model.named_parameters())
    norms = {n: params[n].detach().float().numpy() for n in params if n.endswith("_norm.weight")}
    state, norms, quant, report = apply_awq(state, norms, stats, src.config.intermediate_size, group, True)
    with torch.no_grad():
        for n, w in norms.items():
            params[n].copy_(torch.from_numpy(w))
    scaled = sorted(n for n, r in report.items() if r["alpha"] > 0)
    ratio = float(np.mean([r["error_ratio"] for r in report.values()]))
    note(f"    {len(scaled)} of {len(report)} scaled; calibration output error x{ratio:.3f} of unscaled")
    return state, quant, {"text": desc, "tokens": len(ids), "scaled": len(scaled), "matrices": len(report),
                   "mean_error_ratio": ratio, "alphas": {n: r["alpha"] for n, r in report.items()}}


def weight_cost(model: Transformer, src: Source, prompt: list[int], requantize: bool = False) -> dict:
    """What storing the weights quantized costs against the source's own values (torch, float
    cache, every prompt position): the exporter's parity check above compares like with like.
    For a GGUF those values are its blocks dequantized: blocks kept as they are give the same
    values, so a KLD of 0 says they were kept exactly, not what 4 bits cost against the model
    the GGUF was made from (docs/weights.md measures that against the float-weights bundle)."""
    ref = Transformer.loaded(model.cfg, src.state_dict).eval()
    q = Transformer.loaded(model.cfg, {}).eval()  # zeros, not random draws: every weight is loaded below
    if src.config.tie_word_embeddings:  # stored apart (quantize_model): untie before loading both
        q.lm_head.weight = torch.nn.Parameter(q.embed.weight.detach().clone())
    q.load_state_dict({k: v.float() for k, v in model.state_dict().items()}, strict=False)
    s = len(prompt)
    args = (torch.tensor([prompt]), torch.arange(s)[None], causal_mask(0, s), torch.arange(s)[None])
    with torch.no_grad():
        a = ref(*args, *ref.past_like(0, 1))[0][0].double()
        b = q(*args, *q.past_like(0, 1))[0][0].double()
    pa, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    kld = float((pa.exp() * (pa - lb)).sum(-1).mean())
    top1 = float((a.argmax(-1) == b.argmax(-1)).double().mean())
    against = weight_reference(src, requantize)
    note(f"  weights as stored vs {against} (torch, {s} prompt positions): KLD {kld:.4g}, top-1 {100 * top1:.1f} %, "
        f"max|Δlogit| {float((a - b).abs().max()):.3g}")
    return {"vs_source_weights": {"reference": against, "positions": s, "kld": kld, "top1": top1,
                                  "max_abs_logit_diff": float((a - b).abs().max())}}


def weight_reference(src: Source, requantize: bool) -> str:
    """What weight_cost measures against, in words."""
    if not src.blocks:
        return "the source's float weights"
    if requantize:
        return "the GGUF's blocks dequantized (requantized from those values)"
    return ("the GGUF's blocks dequantized, the same values where they are kept: 0 = kept exactly, "
            "not that its 4 bits are lossless")


def stored_weight_bytes(model: Transformer, plan: dict) -> int:
    """The weights as the bundle stores them: the quantized matrices' codes and scales, every other
    parameter in the bundle's float dtype. Two bundles of the same weights get the same number
    whatever their KV scheme (the graph file also holds the scheme's constants: `edgekv eval`'s
    weights MiB is this)."""
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in plan)
    return stored_bytes(plan) + rest
