"""Checkpoint -> verified bundle: the export's steps, in order. Nothing is written to the
destination unless parity passes. Each step's own module: options (what is asked), recipes
(what MODEL means), destination (where the bundle goes), kv_calibration and quantize (the values
the model holds), graph_file (the ONNX file and its checks), manifest, parity."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from edgekv.errors import ExportError, note
from edgekv.format.bundle import load_bundle
from edgekv.tools.progress import stage
from export.destination import check_out_dir, check_room, default_out_dir, install, share, staging
from export.graph_file import write_graph
from export.kv_calibration import calibrate
from export.kv_gate import AUTO, AUTO_CHOICES, verdict_line
from export.gguf_loader import gguf_matrix_types
from export.source import Source
from export.manifest import build_manifest, weights_manifest, write_manifest
from export.model import Transformer
from export.options import ExportOptions
from export.parity import parity_prompt, verify_parity
from export.quantize import quantize_model, stored_weight_bytes, weight_cost
from export.recipes import DEFAULT_RECIPE, load_source, locate_source, source_weights


@dataclass(frozen=True)
class Destination:
    """Settled before the model is loaded: the source, its recipe, the weights format (auto
    resolved) and the bundle folder."""
    path: Path
    recipe: dict
    weights: str
    out_dir: Path


@dataclass(frozen=True)
class Prepared:
    """The model as the bundle stores it, and what decided its values."""
    model: Transformer
    max_context: int
    plan: dict  # weight name -> its stored QuantWeights (empty: float weights)
    awq: dict | None
    calibration: dict | None
    kv: str  # the scheme stored (--kv auto resolved)


def export_bundle(model_arg: str | None = None, **options) -> Path:
    """The library's entry: keywords as ExportOptions' fields (weights default to float)."""
    return run_export(ExportOptions(model=model_arg, **options))


def cmd_export(args) -> int:
    """`edgekv export` (edgekv/cli.py dispatches here by name)."""
    run_export(ExportOptions.from_args(args))
    return 0


def run_export(opts: ExportOptions) -> Path:
    t0 = time.time()
    dest = settle_destination(opts)
    with stage("loading", f" {opts.model or DEFAULT_RECIPE}"):
        src = load_source(dest.path)
    check_room(dest.out_dir, least_bytes(src, opts.dtype, dest.weights))  # a full disk: before the long steps
    made = prepare_model(opts, dest, src, t0)
    with staging(dest.out_dir, stored_weight_bytes(made.model, made.plan)) as tmp:
        write_graph(made.model, made.plan, tmp, opts.dtype)
        (tmp / "tokenizer.json").write_text(src.tokenizer_json)
        manifest = bundle_manifest(opts, dest, src, made)
        write_manifest(tmp, manifest)
        note(f"  graph written and checked  [{time.time() - t0:.1f}s]")
        manifest["parity"] = check_parity(opts, src, made, tmp)
        write_manifest(tmp, manifest)
        # replaced as a whole, only once the new bundle passed its checks
        check_out_dir(dest.out_dir, opts.force)  # again: it may have changed during the export
        install(tmp, dest.out_dir)
    note(f"✓ bundle written: {dest.out_dir}  [{time.time() - t0:.1f}s]")
    return dest.out_dir


def least_bytes(src: Source, dtype: str, weights: str) -> int:
    """The bundle's weights at the least, known once the source is loaded: every parameter at
    the float dtype's width, or for quantized weights at 4 bits (no format stores fewer)."""
    seen, n = set(), 0
    for t in src.state_dict.values():
        if (t.data_ptr(), t.numel()) not in seen:  # a tied table once
            seen.add((t.data_ptr(), t.numel()))
            n += t.numel()
    return n * (2 if dtype == "float16" else 4) if weights == "float" else n // 2


def settle_destination(opts: ExportOptions) -> Destination:
    """Everything about the destination is settled before the model is loaded (tens of seconds)."""
    path, recipe = locate_source(opts.model)
    out, force = opts.out, opts.force
    if out:
        check_out_dir(Path(out), force)
    weights, why = source_weights(path, opts.weights)
    named = AUTO_CHOICES[1] if opts.kv == AUTO else opts.kv  # either choice is an int8 cache
    out_dir = Path(out) if out else default_out_dir(recipe["name"], named, opts.dtype, weights)
    check_out_dir(out_dir, force)
    note(f"weights: {weights} ({why}); bundle: {out_dir}")
    return Destination(path, recipe, weights, out_dir)


def prepare_model(opts: ExportOptions, dest: Destination, src: Source, t0: float) -> Prepared:
    """The torch model for the bundle's context, calibrated for its KV scheme, its weights
    quantized as they will be stored, in the bundle's dtype."""
    cfg = src.config
    max_context = opts.max_context or dest.recipe.get("max_context") or min(cfg.max_position_embeddings, 4096)
    if max_context > cfg.max_position_embeddings:
        note(f"  note: --max-context {max_context} is beyond the model's trained {cfg.max_position_embeddings}")
    note(f"  {cfg.arch}: {cfg.n_layers} layers, {cfg.n_heads} heads ({cfg.n_kv_heads} KV), head_dim {cfg.head_dim}, "
         f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}  [{time.time() - t0:.1f}s]")
    torch_dtype = {"float32": torch.float32, "float16": torch.float16}[opts.dtype]
    kv = AUTO_CHOICES[0] if opts.kv == AUTO else opts.kv
    model = Transformer.loaded(cfg.for_context(max_context), src.state_dict, kv)  # LongRoPE: one factor set for the bundle's positions
    calibration = None
    if model.scheme.kind == "static" or model.scheme.center_keys:
        with stage("calibrating", f" {kv}"):
            calibration = calibrate(model, src, kv, opts.calib_text, opts.calib_tokens, max_context)
        check = calibration.get("held_out")
        if check:
            note(verdict_line(opts.kv, check))
            if opts.kv == AUTO and not check["passed"]:
                kv, calibration = AUTO_CHOICES[1], None
                model = Transformer.loaded(cfg.for_context(max_context), src.state_dict, kv)
    plan, awq = {}, None
    if dest.weights != "float":
        with stage("quantizing weights", f" to {dest.weights}"):
            plan, awq = quantize_model(model, src, dest.weights, opts.group, opts.method, opts.requantize, opts.calib)
    return Prepared(model.to(torch_dtype).eval(), max_context, plan, awq, calibration, kv)


def bundle_manifest(opts: ExportOptions, dest: Destination, src: Source, made: Prepared) -> dict:
    manifest = build_manifest(src, dest.recipe, made.kv, opts.dtype, made.max_context)
    file_types = gguf_matrix_types(dest.path) if src.kind == "gguf" else {}
    manifest["weights"] = weights_manifest(dest.weights, made.plan, opts.group, opts.method, made.awq, file_types)
    manifest["weights"]["source_blocks_kept"] = bool(src.blocks) and not opts.requantize
    manifest["weights"]["bytes"] = stored_weight_bytes(made.model, made.plan)
    if made.calibration:
        manifest["kv"]["calibration"] = made.calibration
    return manifest


def check_parity(opts: ExportOptions, src: Source, made: Prepared, folder: Path) -> dict:
    """The bundle in `folder` run by the runtime against torch; the manifest's parity record, or an
    ExportError (nothing written) if they differ."""
    from edgekv.runtime.text import TextCodec

    prompt = parity_prompt(src, TextCodec(load_bundle(folder)))
    with stage("verifying ONNX Runtime against PyTorch", f": prefill {len(prompt)} tokens, {opts.steps} decode steps"):
        par, info = verify_parity(made.model, folder, prompt, opts.steps, made.max_context, opts.threads)
    par.report()
    if made.plan:
        info["weight_quantization"] = weight_cost(made.model, src, prompt, opts.requantize)
    share(folder)
    if not par.ok:
        raise ExportError("parity check failed: ONNX does not match PyTorch; nothing written")
    return {"passed": True, **info, "outputs": par.rows}
