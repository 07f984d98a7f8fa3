"""The exporter's parity check: ONNX Runtime (through the edgekv runtime and its cache) against
torch on the same inputs, before anything is written (docs/graph.md)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgekv.errors import note
from edgekv.format.bundle import PARITY_LOGITS, io_names
from edgekv.format.kvschemes import unpack_int4
from edgekv.runtime.cache import KVCache
from export.source import Source
from export.kv_torch import kv_load
from export.model import Transformer, causal_mask


def parity_prompt(src: Source, codec) -> list[int]:
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    try:
        ids = codec.chat_ids(msgs)
    except Exception:
        ids = []
    if len(ids) < 8:  # tiny test tokenizers: fall back to fixed pseudo-random tokens
        ids = list(np.random.default_rng(0).integers(0, src.config.vocab_size, 24))
    return ids


class Parity:
    def __init__(self):
        self.rows: dict[str, dict] = {}

    def add(self, name: str, diff: float, tol: float, extra: str = ""):
        r = self.rows.setdefault(name, {"max_abs_diff": 0.0, "tol": tol, "note": ""})
        r["max_abs_diff"] = max(r["max_abs_diff"], float(diff))
        if extra:
            r["note"] = extra

    @property
    def ok(self) -> bool:
        return all(r["max_abs_diff"] <= r["tol"] for r in self.rows.values())

    def report(self) -> None:
        for name, r in self.rows.items():
            mark = "✓" if r["max_abs_diff"] <= r["tol"] else "✗"
            note(f"  {mark} {name:<28} max|diff| = {r['max_abs_diff']:.3g}  (tol {r['tol']:.3g}){('  ' + r['note']) if r['note'] else ''}")


def verify_parity(model: Transformer, bundle_dir: Path, prompt: list[int], steps: int, max_context: int,
           threads: int | None = None) -> tuple[Parity, dict]:
    """ONNX Runtime (through the edgekv runtime and its cache) against torch on the same inputs:
    a prefill, `steps` decode steps fed torch's greedy tokens, and a chunk at the far end of RoPE.

    A quantized cache makes the comparison chaotic: a float difference of 1e-7 between torch and
    onnxruntime flips an int8 rounding now and then, and each flip perturbs every later layer
    (docs/graph.md). So for a quantized scheme the logits tolerance is set from the quantization noise itself, measured on
    the same inputs (torch with this scheme against torch with a float cache), and the cache is
    compared dequantized, as an RMS ratio, against the same yardstick. A real bug (wrong layout, scale, order) is far outside
    both bounds; the float scheme is held to plain float tolerances."""
    from edgekv.runtime.assemble import open_runtime

    # float activations in the fused low-bit MatMul (accuracy level 0): ONNX = torch on the same weights
    with open_runtime(bundle_dir, min(max_context, len(prompt) + steps + 1), "ort-cpu", threads,
                      matmul_accuracy=0) as rt:
        return parity_rows(model, rt.bundle, rt.stream(), prompt, steps, max_context)


def float_twin(model: Transformer, fp16: bool) -> Transformer | None:
    """The same weights with a float cache in float32: the yardstick for quantization and fp16
    noise (None when the model is that already)."""
    if model.scheme.name == "float" and not fp16:
        return None
    ref = Transformer.loaded(model.cfg, {k: v.float() for k, v in model.state_dict().items()}).eval()
    return ref


def torch_step(m: Transformer, ids: list[int], past: list | None, pos0: int, dtype) -> tuple[np.ndarray, list]:
    """One call of the torch model on `ids` at positions pos0.. after `past`: the last row's
    logits and the past with the new tokens' K/V appended."""
    s = len(ids)
    p = 0 if not past else past[0].shape[0]
    with torch.no_grad():
        out = m(torch.tensor([ids]), torch.arange(pos0, pos0 + s)[None], causal_mask(p, s),
                torch.tensor([[s - 1]]), *(past or m.past_like(0, 1, dtype)))
    logits, present = out[0][0, -1].float().numpy(), out[1:]
    new_past = [torch.cat([a, b], 0) for a, b in zip(past, present)] if past else list(present)
    return logits, new_past


@dataclass
class SideBySide:
    """torch, its float twin (if any) and onnxruntime, prefilled on the prompt and then decoded
    on torch's greedy tokens: every step's logits, both greedy choices, torch's final pasts."""
    torch_logits: list
    ort_logits: list
    ref_logits: list
    torch_tokens: list
    ort_tokens: list
    past: list
    ref_past: list | None


def run_side_by_side(model: Transformer, ref: Transformer | None, stream, prompt: list[int], steps: int) -> SideBySide:
    dtype = next(model.parameters()).dtype
    t_logits, past = torch_step(model, prompt, None, 0, dtype)
    run = SideBySide([t_logits], [stream.prefill(prompt).copy()], [], [], [], past, None)
    if ref is not None:
        r_logits, run.ref_past = torch_step(ref, prompt, None, 0, dtype)
        run.ref_logits.append(r_logits)
    for _ in range(steps):
        t_tok, o_tok = int(np.argmax(run.torch_logits[-1])), int(np.argmax(run.ort_logits[-1]))
        run.torch_tokens.append(t_tok)
        run.ort_tokens.append(o_tok)
        pos = len(prompt) + len(run.torch_tokens) - 1
        t_logits, run.past = torch_step(model, [t_tok], run.past, pos, dtype)
        if ref is not None:
            r_logits, run.ref_past = torch_step(ref, [t_tok], run.ref_past, pos, dtype)
            run.ref_logits.append(r_logits)
        run.torch_logits.append(t_logits)
        run.ort_logits.append(stream.decode_step(t_tok).copy())
    return run


def add_logits_rows(par: Parity, run: SideBySide, model: Transformer, fp16: bool, steps: int) -> tuple[float, float]:
    """The logits and greedy-token rows; returns the logits tolerance and the quantization noise."""
    t_log, o_log, r_log = run.torch_logits, run.ort_logits, run.ref_logits
    quantized = model.scheme.name != "float"
    base_tol = 0.02 if fp16 else 2e-3
    noise = max(float(np.abs(a - b).max()) for a, b in zip(t_log, r_log)) if r_log else 0.0
    tol = max(base_tol, 2.0 * noise)
    what = " + ".join(([model.scheme.name] if quantized else []) + (["fp16"] if fp16 else []))
    why = f"{what} noise (torch {what} vs torch float32, float cache) {noise:.3g}" if r_log else ""
    par.add("logits (prefill)", np.abs(t_log[0] - o_log[0]).max(), tol, why)
    par.add(PARITY_LOGITS, max(np.abs(a - b).max() for a, b in zip(t_log[1:], o_log[1:])), tol, why)
    # a different greedy token is a failure unless torch itself had the two within the tolerance
    # (a near-tie that fp16 or a flipped quantization step may legitimately turn over)
    t_tokens, o_tokens = run.torch_tokens, run.ort_tokens
    agree = sum(a == b for a, b in zip(t_tokens, o_tokens))
    ties = sum(a != b and t_log[i][a] - t_log[i][b] <= tol for i, (a, b) in enumerate(zip(t_tokens, o_tokens)))
    par.add("greedy tokens", steps - agree - ties, 0,
            f"{agree}/{steps} identical" + (f", {ties} near-tie(s) within tol" if ties else ""))
    return tol, noise


def rms_ratio(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(((a - ref) ** 2).mean()) / max(np.sqrt((ref ** 2).mean()), 1e-12))


def add_cache_rows(par: Parity, model: Transformer, ref: Transformer | None, run: SideBySide, stream, fp16: bool) -> None:
    """The cache the runtime filled (present.* written in place) against torch's presents."""
    quantized = model.scheme.name != "float"
    held = runtime_rows(stream)
    worst_rms, worst_l0, noise_rms = 0.0, 0.0, 0.0
    for i in range(model.cfg.n_layers):
        for j, kv in enumerate(("key", "value")):
            rms, noise, l0 = layer_cache_diff(model, ref, run, held, i, j, kv)
            worst_rms, noise_rms, worst_l0 = max(worst_rms, rms), max(noise_rms, noise), max(worst_l0, l0)
    par.add("present.* (cache, RMS ratio)", worst_rms,
            max(0.05, 2 * noise_rms) if quantized else (1e-2 if fp16 else 1e-4),
            f"dequantized, worst layer; quantization noise {noise_rms:.3g}" if quantized else "worst layer")
    if quantized:
        par.add("present.0.* (int steps)", worst_l0, 1.0, "layer 0, before any flip can cascade")


def layer_cache_diff(model: Transformer, ref: Transformer | None, run: SideBySide, held: dict, i: int, j: int,
                     kv: str) -> tuple[float, float, float]:
    """Layer i's key (j = 0) or value cache: the runtime's (`held`: runtime_rows) against
    torch's (dequantized, RMS ratio), torch's against the float twin's (the noise yardstick),
    and layer 0's largest integer step."""
    names = io_names(model.cfg.n_layers, model.scheme)["past"]
    n = len(model.scheme.tensors)
    lo = names.index(f"past.{i}.{kv}")
    t_t, o_t = run.past[lo: lo + n], [torch.from_numpy(held[nm]) for nm in names[lo: lo + n]]
    if o_t[0].shape[0] < t_t[0].shape[0]:  # a windowed cache's local layer: its last tokens
        t_t = [t[t.shape[0] - o_t[0].shape[0]:] for t in t_t]
    sc = model.layers[i].attn.scales()[j]
    sc = None if sc is None else sc.float()
    t = kv_load(model.scheme, t_t, torch.float32, sc).numpy()
    o = kv_load(model.scheme, o_t, torch.float32, sc).numpy()
    noise, l0 = 0.0, 0.0
    if run.ref_past is not None:  # the same layer's cache with a float cache all along: the noise yardstick
        r = run.ref_past[io_names(model.cfg.n_layers, ref.scheme)["past"].index(f"past.{i}.{kv}")].float().numpy()
        if model.scheme.rotate:  # this scheme caches K/V in the rotated basis
            r = r @ model.layers[i].attn.had.float().numpy()
        if kv == "key" and model.scheme.center_keys:  # ... and its keys centered
            r = r - model.layers[i].attn.k_offset.float().numpy()
        noise = rms_ratio(t, r[len(r) - len(t):])  # (a windowed local layer: its kept tokens)
    if i == 0 and model.scheme.name != "float":
        a, b = t_t[0].numpy(), o_t[0].numpy()
        if model.scheme.kind == "packed4":  # compare the int4 values, not the packed bytes
            a, b = unpack_int4(a), unpack_int4(b)
        l0 = float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max())
    return rms_ratio(o, t), noise, l0


def runtime_rows(stream) -> dict[str, np.ndarray]:
    """The K/V rows the runtime holds, per buffer, in the order they were fed: the sequence's
    cells, or a windowed pool's local layer's window ring's kept tokens (position p in the ring's
    slot p mod its length). One read of the cells and one of the ring."""
    cache, seq = stream.cache, stream.seq
    rows = cache.read_cells(seq.cells)
    if cache.local_names:
        held = seq.window_positions()
        kept = np.sort(held[held >= 0]) % cache.local_ring
        rows.update({name: r[kept] for name, r in cache.read_ring(seq.window_ring).items()})
    return rows


def far_logits(stream, bundle, ids: list[int], start: int) -> np.ndarray:
    """The last row's logits of one graph call of `ids` at positions start.. on an empty cache of
    their own (RoPE at the end of the verified context, which a pool sequence, always fed from
    position 0, does not reach without filling it)."""
    backend, s = stream.batcher.backend, len(ids)
    cache, window = KVCache(bundle, s, memory=backend.memory), bundle.window
    d = np.arange(s)[:, None] - np.arange(s)[None, :]
    causal = (d >= 0)[None]
    local = (causal & (d < window)) if window else None
    logits = backend.run_cells(cache, 0, 0, np.asarray([ids], np.int64), np.arange(start, start + s)[None],
                               causal, np.array([[s - 1]], np.int64), local)
    return logits[0, -1].copy()


def parity_rows(model: Transformer, bundle, stream, prompt: list[int], steps: int, max_context: int) -> tuple[Parity, dict]:
    """verify_parity's comparisons, on a stream of the runtime's batcher over `bundle`."""
    par = Parity()
    fp16 = bundle.dtype == "float16"
    ref = float_twin(model, fp16)
    run = run_side_by_side(model, ref, stream, prompt, steps)
    tol, noise = add_logits_rows(par, run, model, fp16, steps)
    add_cache_rows(par, model, ref, run, stream, fp16)
    # far positions: RoPE at the end of the verified context
    k = min(16, len(prompt))
    o = far_logits(stream, bundle, prompt[:k], max_context - k)
    t, _ = torch_step(model, prompt[:k], None, max_context - k, next(model.parameters()).dtype)
    par.add(f"logits (positions to {max_context})", np.abs(t - o).max(), tol)
    return par, {"prompt_tokens": len(prompt), "decode_steps": steps, "greedy_tokens": run.torch_tokens,
                 "quantization_noise": noise}
