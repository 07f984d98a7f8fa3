"""Checkpoint -> verified bundle. Nothing is written to the destination unless parity passes."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch

import edgekv
from edgekv.errors import ExportError, note
from edgekv.tools.progress import stage
from edgekv.format.bundle import MANIFEST, PARITY_LOGITS, VERIFIED, file_sha256, io_names, manifest_version
from edgekv.format.files import kind_of, replace_dir, replace_dir_keeping, write_text
from edgekv.format.kvschemes import INT4_GROUP, INT4_LEVELS, get_scheme, unpack_int4
from export.loaders import Source, SourceError, gguf_matrix_types, load_gguf, load_hf_folder
from export.model import Transformer, UnsupportedModel, causal_mask
from export.weights import GROUPS, KEPT_BITS, METHODS, WEIGHT_FORMATS, auto_format, plan_weights, stored_bytes, summary

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
DEFAULT_RECIPE = "smollm2-135m-instruct"
TRT_TARGET = "10.3"  # JetPack 6's TensorRT: every bundle must pass its parser rules
WEIGHT_DEFAULT = "auto"  # `edgekv export --weights`: keep what the source holds (source_weights)
WEIGHT_CHOICES = (WEIGHT_DEFAULT, *WEIGHT_FORMATS)


# what decides a bundle's contents: the exporter, the format, scheme and TensorRT parser-rule
# definitions (edgekv/format/trt_rules.py), the recipes (and, below, the torch and onnx versions)
_SOURCE_GLOBS = ("export/*.py", "edgekv/format/*.py", "edgekv/data/*.json", "models/*.json")


def exporter_source_key(root: Path | None = None) -> str:
    """A hash of everything that decides what a bundle holds. The manifest records it, so a bundle
    made by other code (an older exporter) can be told apart and not reused by the tests."""
    import hashlib

    root = root or Path(__file__).resolve().parent.parent
    h = hashlib.sha256(f"torch {torch.__version__} onnx {onnx.__version__}\n".encode())
    for f in sorted({f for g in _SOURCE_GLOBS for f in root.glob(g)}):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


# --- what MODEL means ----------------------------------------------------------------------

def recipe_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def resolve_source(model: str | None) -> tuple[Source, dict]:
    """MODEL: a recipe name from models/, a Hugging Face folder, or a .gguf file."""
    path, recipe = locate_source(model)
    return load_source(path), recipe


def locate_source(model: str | None) -> tuple[Path, dict]:
    """MODEL -> (the folder or .gguf file, its recipe), without reading any weights."""
    model = model or DEFAULT_RECIPE
    recipe = {}
    if (MODELS_DIR / f"{model}.json").is_file():
        recipe = json.loads((MODELS_DIR / f"{model}.json").read_text())
        path = recipe_path(recipe)
    else:
        path = Path(model)
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        if path.exists():
            raise ExportError(f"{path}: not a model (give a Hugging Face folder, a .gguf file or a recipe: "
                              f"{', '.join(recipe_names())})")
        raise ExportError(f"{model}: no such recipe, folder or .gguf file (recipes: {', '.join(recipe_names())})")
    recipe.setdefault("name", _default_name(path))
    return path, recipe


def load_source(path: Path) -> Source:
    """The model's weights, tokenizer and config (the slow part: tens of seconds for a GGUF)."""
    try:
        return load_hf_folder(path) if path.is_dir() else load_gguf(path)
    except (SourceError, UnsupportedModel) as e:
        raise ExportError(str(e)) from None
    except (KeyError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: unreadable model config ({type(e).__name__}: {e})") from None


def source_weights(path: Path, weights: str) -> tuple[str, str]:
    """--weights resolved (auto: what the source holds, read from its header) and a phrase of why."""
    if weights != "auto":
        return weights, "as asked"
    if path.is_dir():
        return "float", "auto: a Hugging Face folder holds float weights"
    try:
        types = gguf_matrix_types(path)
    except SourceError as e:
        raise ExportError(str(e)) from None
    fmt = auto_format(types, "embed.weight", "lm_head.weight")
    held = ", ".join(sorted({t for ts in types.values() for t in ts})) or "no 2-D weights"
    if fmt == "float":
        return fmt, (f"auto: the GGUF holds {held}; only {', '.join(KEPT_BITS)} blocks are kept as they are, so its "
                     f"values are stored as float (--weights int4 or int8 requantizes)")
    return fmt, f"auto: the GGUF's own {held} blocks, kept exactly"


def recipe_path(recipe: dict) -> Path:
    src = recipe["source"]
    spec = importlib.util.find_spec(src["package"])
    if spec is None or not spec.submodule_search_locations:
        raise ExportError(f"recipe {recipe['name']}: package {src['package']} is not installed "
                          f"({src['install']})")
    return Path(list(spec.submodule_search_locations)[0]) / src["file"]


def _default_name(path: Path) -> str:
    return (path.stem if path.suffix == ".gguf" else path.name).lower().replace(".", "-")


# --- parity --------------------------------------------------------------------------------

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


def verify(model: Transformer, bundle_dir: Path, prompt: list[int], steps: int, max_context: int,
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
        return compare(model, rt.bundle, rt.generator(), prompt, steps, max_context)


def compare(model: Transformer, bundle, gen, prompt: list[int], steps: int, max_context: int) -> tuple[Parity, dict]:
    """verify's comparisons, on the runtime's generator `gen` of `bundle`."""
    cache = gen.cache
    names = io_names(model.cfg.n_layers, model.scheme)
    par = Parity()
    fp16 = bundle.dtype == "float16"
    dtype = next(model.parameters()).dtype
    quantized = model.scheme.name != "float"
    ref = None
    if quantized or fp16:  # same weights, float cache, float32: the yardstick for quantization and fp16 noise
        ref = Transformer(model.cfg, "float").eval()
        ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()}, strict=False)

    def torch_step(m, ids, past, pos0):
        s = len(ids)
        p = 0 if not past else past[0].shape[0]
        with torch.no_grad():
            out = m(torch.tensor([ids]), torch.arange(pos0, pos0 + s)[None], causal_mask(p, s),
                    torch.tensor([[s - 1]]), *(past or m.past_like(0, 1, dtype)))
        logits, present = out[0][0, -1].float().numpy(), out[1:]
        new_past = [torch.cat([a, b], 0) for a, b in zip(past, present)] if past else list(present)
        return logits, new_past

    # prefill, then decode fed torch's greedy tokens; record every step's logits
    t_log, o_log, r_log = [], [], []
    t_logits, past = torch_step(model, prompt, None, 0)
    r_past = None
    if ref is not None:
        r_logits, r_past = torch_step(ref, prompt, None, 0)
        r_log.append(r_logits)
    o_logits = gen.prefill(prompt).copy()
    t_log.append(t_logits)
    o_log.append(o_logits)
    t_tokens, o_tokens = [], []
    for _ in range(steps):
        t_tok, o_tok = int(np.argmax(t_logits)), int(np.argmax(o_logits))
        t_tokens.append(t_tok)
        o_tokens.append(o_tok)
        pos = len(prompt) + len(t_tokens) - 1
        t_logits, past = torch_step(model, [t_tok], past, pos)
        if ref is not None:
            r_logits, r_past = torch_step(ref, [t_tok], r_past, pos)
            r_log.append(r_logits)
        o_logits = gen.decode_step(t_tok).copy()
        t_log.append(t_logits)
        o_log.append(o_logits)
    base_tol = 0.02 if fp16 else 2e-3
    noise = max(float(np.abs(a - b).max()) for a, b in zip(t_log, r_log)) if ref is not None else 0.0
    tol = max(base_tol, 2.0 * noise)
    what = " + ".join(([model.scheme.name] if quantized else []) + (["fp16"] if fp16 else []))
    why = f"{what} noise (torch {what} vs torch float32, float cache) {noise:.3g}" if ref is not None else ""
    par.add("logits (prefill)", np.abs(t_log[0] - o_log[0]).max(), tol, why)
    par.add(PARITY_LOGITS, max(np.abs(a - b).max() for a, b in zip(t_log[1:], o_log[1:])), tol, why)
    # a different greedy token is a failure unless torch itself had the two within the tolerance
    # (a near-tie that fp16 or a flipped quantization step may legitimately turn over)
    agree = sum(a == b for a, b in zip(t_tokens, o_tokens))
    ties = sum(a != b and t_log[i][a] - t_log[i][b] <= tol for i, (a, b) in enumerate(zip(t_tokens, o_tokens)))
    par.add("greedy tokens", steps - agree - ties, 0,
            f"{agree}/{steps} identical" + (f", {ties} near-tie(s) within tol" if ties else ""))

    # the cache the runtime filled (present.* written in place) against torch's presents
    from export.model import kv_load

    n = len(model.scheme.tensors)
    worst_rms, worst_l0, noise_rms = 0.0, 0.0, 0.0
    names_ref = io_names(model.cfg.n_layers, ref.scheme)["past"] if ref is not None else []
    for i in range(model.cfg.n_layers):
        for j, kv in enumerate(("key", "value")):
            lo = names["past"].index(f"past.{i}.{kv}")
            t_t = past[lo: lo + n]
            o_t = [torch.from_numpy(cache.memory.read(cache.buffers[nm], gen.seq.n)) for nm in names["past"][lo: lo + n]]
            sc = model.layers[i].attn.scales()[j]
            sc = None if sc is None else sc.float()
            t = kv_load(model.scheme, t_t, torch.float32, sc).numpy()
            o = kv_load(model.scheme, o_t, torch.float32, sc).numpy()
            rms = float(np.sqrt(((t - o) ** 2).mean()) / max(np.sqrt((t ** 2).mean()), 1e-12))
            worst_rms = max(worst_rms, rms)
            if r_past is not None:  # the same layer's cache with a float cache all along: the noise yardstick
                r = r_past[names_ref.index(f"past.{i}.{kv}")].float().numpy()
                if model.scheme.rotate:  # this scheme caches K/V in the rotated basis
                    r = r @ model.layers[i].attn.had.float().numpy()
                if kv == "key" and model.scheme.center_keys:  # ... and its keys centered
                    r = r - model.layers[i].attn.k_offset.float().numpy()
                noise_rms = max(noise_rms, float(np.sqrt(((t - r) ** 2).mean()) / max(np.sqrt((r ** 2).mean()), 1e-12)))
            if i == 0 and quantized:
                a, b = t_t[0].numpy(), o_t[0].numpy()
                if model.scheme.kind == "packed4":  # compare the int4 values, not the packed bytes
                    a, b = unpack_int4(a), unpack_int4(b)
                worst_l0 = max(worst_l0, float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max()))
    par.add("present.* (cache, RMS ratio)", worst_rms,
            max(0.05, 2 * noise_rms) if quantized else (1e-2 if fp16 else 1e-4),
            f"dequantized, worst layer; quantization noise {noise_rms:.3g}" if quantized else "worst layer")
    if quantized:
        par.add("present.0.* (int steps)", worst_l0, 1.0, "layer 0, before any flip can cascade")

    # far positions: RoPE at the end of the verified context
    k = min(16, len(prompt))
    gen.reset(pos=max_context - k)
    o = gen.prefill(prompt[:k]).copy()
    t, _ = torch_step(model, prompt[:k], None, max_context - k)
    par.add(f"logits (positions to {max_context})", np.abs(t - o).max(), tol)
    return par, {"prompt_tokens": len(prompt), "decode_steps": steps, "greedy_tokens": t_tokens,
                 "quantization_noise": noise}


# --- the export ----------------------------------------------------------------------------

def export_bundle(model_arg: str | None, kv: str = "int8", out: str | None = None,
                  max_context: int | None = None, dtype: str = "float32", steps: int = 32,
                  threads: int | None = None, calib_text: str | None = None, calib_tokens: int = 4096,
                  force: bool = False, weights: str = "float", group: int = 32, method: str = "awq",
                  requantize: bool = False) -> Path:
    """The library's default weights stay float (the tests' float-weights reference bundle is made
    by this default); `edgekv export` defaults to auto (WEIGHT_DEFAULT)."""
    t0 = time.time()
    try:
        get_scheme(kv)
    except ValueError as e:
        raise ExportError(str(e)) from None
    if weights not in WEIGHT_CHOICES:
        raise ExportError(f"unknown weight format {weights!r}; known: {', '.join(WEIGHT_CHOICES)}")
    if group not in GROUPS:
        raise ExportError(f"--group {group}: choose one of {', '.join(map(str, GROUPS))}")
    if method not in METHODS:
        raise ExportError(f"--requant-method {method}: choose one of {', '.join(METHODS)}")
    # everything about the destination is settled before the model is loaded (tens of seconds)
    path, recipe = locate_source(model_arg)
    if out:
        check_out_dir(Path(out), force)
    weights, why = source_weights(path, weights)
    suffix = ("-fp16" if dtype == "float16" else "") + ("" if weights == "float" else f"-w{weights}")
    out_dir = Path(out) if out else MODELS_DIR / "bundles" / f"{recipe['name']}-{kv}{suffix}"
    check_out_dir(out_dir, force)
    note(f"weights: {weights} ({why}); bundle: {out_dir}")
    with stage("loading", f" {model_arg or DEFAULT_RECIPE}"):
        src = load_source(path)
    cfg = src.config
    max_context = max_context or recipe.get("max_context") or min(cfg.max_position_embeddings, 4096)
    if max_context > cfg.max_position_embeddings:
        note(f"  note: --max-context {max_context} is beyond the model's trained {cfg.max_position_embeddings}")
    note(f"  {cfg.arch}: {cfg.n_layers} layers, {cfg.n_heads} heads ({cfg.n_kv_heads} KV), head_dim {cfg.head_dim}, "
        f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}  [{time.time() - t0:.1f}s]")
    torch_dtype = {"float32": torch.float32, "float16": torch.float16}[dtype]
    model = Transformer(cfg.for_context(max_context), kv)  # LongRoPE: one factor set for the bundle's positions
    model.load_state_dict(src.state_dict, strict=False)  # inv_freq is computed, lm_head may be tied
    calibration = None
    if model.scheme.kind == "static" or model.scheme.center_keys:
        with stage("calibrating", f" {kv}"):
            calibration = calibrate(model, src, kv, calib_text, calib_tokens)
    plan, awq = {}, None
    if weights != "float":
        with stage("quantizing weights", f" to {weights}"):
            plan, awq = quantize_model(model, src, weights, group, method, requantize, (calib_text, calib_tokens))
    model = model.to(torch_dtype).eval()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        with stage("exporting ONNX", f" (kv={kv}, dtype={dtype}; torch.export: the slowest step)"):
            from export.onnx_export import export_onnx, save_onnx

            proto = export_onnx(model, plan)
            save_onnx(proto, tmp / "model.onnx")
            del proto
            store_identical_once(tmp / "model.onnx")
        with stage("checking the graph", " (onnx.checker full, TensorRT parser rules)"):
            onnx.checker.check_model(str(tmp / "model.onnx"), full_check=True)
            from edgekv.format.trt_rules import check_as_built
            from edgekv.runtime.backends.engines import tensorrt_graph

            violations, converted = check_as_built(tmp / "model.onnx", TRT_TARGET, tensorrt_graph)
        if violations:
            for v in violations[:10]:
                note(f"  ✗ TensorRT {TRT_TARGET}: {v}")
            raise ExportError(f"the graph breaks {len(violations)} TensorRT {TRT_TARGET} parser rule(s); nothing written")
        note(f"  ✓ TensorRT {TRT_TARGET} parser rules (edgekv check-trt)"
             + (f"; {len(converted)} 8-bit block-wise weight(s) go per channel at engine build" if converted else ""))
        (tmp / "tokenizer.json").write_text(src.tokenizer_json)
        manifest = build_manifest(src, recipe, kv, dtype, max_context, tmp)
        file_types = gguf_matrix_types(path) if src.kind == "gguf" else {}
        manifest["weights"] = weights_manifest(weights, plan, group, method, awq, file_types)
        manifest["weights"]["source_blocks_kept"] = bool(src.blocks) and not requantize
        manifest["weights"]["bytes"] = stored_weight_bytes(model, plan)
        if calibration:
            manifest["kv"]["calibration"] = calibration
        _write_manifest(tmp, manifest)
        note(f"  graph written and checked  [{time.time() - t0:.1f}s]")

        from edgekv.runtime.text import TextCodec
        from edgekv.format.bundle import load_bundle

        codec = TextCodec(load_bundle(tmp))
        prompt = parity_prompt(src, codec)
        with stage("verifying ONNX Runtime against PyTorch", f": prefill {len(prompt)} tokens, {steps} decode steps"):
            par, info = verify(model, tmp, prompt, steps, max_context, threads)
        par.report()
        if plan:
            info["weight_quantization"] = weight_cost(model, src, prompt, requantize)
        for f in [tmp, *tmp.iterdir()]:  # mkdtemp makes 0700; a bundle is meant to be shared
            f.chmod(0o755 if f.is_dir() else 0o644)
        if not par.ok:
            raise ExportError("parity check failed: ONNX does not match PyTorch; nothing written")
        manifest["parity"] = {"passed": True, **info, "outputs": par.rows}
        _write_manifest(tmp, manifest)
        # replaced as a whole, only once the new bundle passed its checks
        check_out_dir(out_dir, force)  # again: it may have changed during the export
        install(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    note(f"✓ bundle written: {out_dir}  [{time.time() - t0:.1f}s]")
    return out_dir


def install(tmp: Path, out_dir: Path) -> None:
    """Put the checked bundle `tmp` at out_dir. Of an old bundle there only the files its manifest
    names are replaced; anything else in it stays where it is (engines/ too: an engine records the
    manifest's fingerprint, so the old graph's engines are stale and `build-engine` rebuilds them).
    A folder that is not a bundle (--force) is moved aside whole. One line says what was kept."""
    owned = bundle_files(out_dir)
    if owned is None:
        kept = replace_dir(tmp, out_dir, keep_old=not replaceable(out_dir))
        if kept:
            note(f"  (the folder's old contents are kept in {kept})")
        return
    moved, aside = replace_dir_keeping(tmp, out_dir, owned)
    if moved:
        names = ", ".join(n + ("/" if (out_dir / n).is_dir() else "") for n in moved)
        stale = " (TensorRT engines of the old graph: stale, `edgekv build-engine` rebuilds them)" \
            if "engines" in moved else ""
        note(f"  kept in {out_dir}, not part of the old bundle: {names}{stale}")
    if aside:
        note(f"  (what could not stay in place is kept in {aside})")


def bundle_files(out_dir: Path) -> set[str] | None:
    """The names an old bundle at out_dir is made of (its manifest, the files it lists and the
    verify record edgekv keeps beside them), or None if out_dir is not a bundle."""
    if kind_of(out_dir) != "a folder" or not replaceable(out_dir) or not (out_dir / MANIFEST).is_file():
        return None
    files = json.loads((out_dir / MANIFEST).read_text()).get("files")  # replaceable: a JSON object
    named = set()
    if isinstance(files, dict):
        named = {*(files.get("sizes") if isinstance(files.get("sizes"), dict) else {}),
                 files.get("onnx"), files.get("tokenizer")}
    # only plain names inside the folder: a manifest cannot make export delete anything else
    return {n for n in named if isinstance(n, str) and n not in ("", ".", "..") and Path(n).name == n} \
        | {MANIFEST, VERIFIED}


def replaceable(out_dir: Path) -> bool:
    """An empty folder or an edgekv bundle (its manifest says so): replaced without asking."""
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return True
    try:
        man = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(man, dict) and "format_version" in man


def check_out_dir(out_dir: Path, force: bool) -> None:
    """--out may be nothing, an empty folder or an old bundle; a folder with other things in it
    only with --force (and then its contents are moved aside, never deleted)."""
    kind = kind_of(out_dir)
    if kind not in (None, "a folder"):
        raise ExportError(f"{out_dir}: is {kind}; --out must be a folder (or a new name)")
    above = next(p for p in out_dir.absolute().parents if kind_of(p) is not None)  # "/" at the latest
    if not above.is_dir():
        raise ExportError(f"{out_dir}: cannot make a folder there, {above} is {kind_of(above)}")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ExportError(f"{out_dir}: cannot write in {above} (no permission)")
    if kind and not force and not replaceable(out_dir):
        raise ExportError(f"{out_dir}: a folder with other files, not an edgekv bundle; choose another --out "
                          f"(or --force: its contents are moved aside to {out_dir.name}.old-*, not deleted)")


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
    ref = Transformer(model.cfg, "float").eval()
    ref.load_state_dict(src.state_dict, strict=False)
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


def matrix_records(plan: dict, file_types: dict[str, set[str]]) -> dict:
    """Per stored matrix: the source's type ("Q4_K"; fused parts "Q5_0|Q5_0|Q8_0"; what a
    requantized matrix was, "float" for a Hugging Face folder), how the graph carries it, and its bytes."""
    first = {}
    for name, q in plan.items():
        first.setdefault(id(q), name)
    return {name: {"source": q.source or "|".join(sorted(file_types.get(name, ()))) or "float",
                   "carried": (q.carrier if q.source else f"{q.carrier}, requantized: {q.origin}")
                   + ("" if first[id(q)] == name else f"; the same initializers as {first[id(q)]} (one copy)"),
                   "bytes": q.nbytes if first[id(q)] == name else 0}
            for name, q in sorted(plan.items())}


def weights_manifest(weights: str, plan: dict, group: int, method: str, awq: dict | None,
                     file_types: dict[str, set[str]] | None = None) -> dict:
    total = stored_bytes(plan)
    return {"format": weights, "group": group if weights == "int4" else None,
            "requantize": ({"rtn": "round-to-nearest", "clip": "clip-ratio search"}.get(method)
                           or ("AWQ scales + clip by output error" if awq else "clip-ratio search"))
                          if weights == "int4" else "absmax per block of 32" if weights == "int8" else None,
            "awq": awq,
            "stored": summary(plan), "quantized_bytes": total,
            "embedding": "Gather on the INT8 table, rows scaled after the lookup" if plan else None,
            "head": f"{plan['lm_head.weight'].carrier} (INT8 per output channel in a TensorRT engine)" if plan else None,
            "matrices": matrix_records(plan, file_types or {})}


def weight_cost(model: Transformer, src: Source, prompt: list[int], requantize: bool = False) -> dict:
    """What storing the weights quantized costs against the source's own values (torch, float
    cache, every prompt position): the exporter's parity check above compares like with like.
    For a GGUF those values are its blocks dequantized: blocks kept as they are give the same
    values, so a KLD of 0 says they were kept exactly, not what 4 bits cost against the model
    the GGUF was made from (docs/weights.md measures that against the float-weights bundle)."""
    ref = Transformer(model.cfg, "float").eval()
    ref.load_state_dict(src.state_dict, strict=False)
    q = Transformer(model.cfg, "float").eval()
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


def store_identical_once(onnx_path: Path) -> int:
    """Initializers with identical bytes (a tied head's table and its lookup's copy) point at one
    region of the external weights file (ONNX external data is an offset and a length per tensor;
    nothing requires the regions to differ). Rewrites the graph and its weights file; returns the
    bytes saved."""
    import hashlib

    m = onnx.load(str(onnx_path), load_external_data=False)
    regions, where = {}, {}
    for init in m.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in init.external_data}
            regions[init.name] = (info["location"], int(info.get("offset", 0)), int(info["length"]))
    files = {loc for loc, _, _ in regions.values()}
    if len(files) != 1:
        return 0
    data_path = onnx_path.parent / files.pop()
    data = data_path.read_bytes()
    out = bytearray()
    for init in m.graph.initializer:
        if init.name not in regions:
            continue
        _, off, ln = regions[init.name]
        key = hashlib.sha256(data[off:off + ln]).digest()
        if key not in where:
            where[key] = len(out)
            out += data[off:off + ln]
        for e in init.external_data:
            if e.key == "offset":
                e.value = str(where[key])
        if not any(e.key == "offset" for e in init.external_data):
            init.external_data.add(key="offset", value=str(where[key]))
    saved = len(data) - len(out)
    if saved:
        data_path.write_bytes(bytes(out))
        onnx.save_model(m, str(onnx_path))
    return saved


def stored_weight_bytes(model: Transformer, plan: dict) -> int:
    """The weights as the bundle stores them: the quantized matrices' codes and scales, every other
    parameter in the bundle's float dtype. Two bundles of the same weights get the same number
    whatever their KV scheme (the graph file also holds the scheme's constants: `edgekv eval`'s
    weights MiB is this)."""
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in plan)
    return stored_bytes(plan) + rest


def calibrate(model: Transformer, src: Source, kv: str, calib_text: str | None, calib_tokens: int) -> dict:
    from export.calibrate import calibrate_static, key_mean, set_key_offsets

    ids, desc = calibration_ids(src, calib_text, calib_tokens)
    note(f"  on {len(ids)} tokens of {desc[:60]}...")
    ref = Transformer(model.cfg, "float").eval()
    ref.load_state_dict(src.state_dict, strict=False)
    if model.scheme.center_keys:
        set_key_offsets(model, key_mean(ref, ids))
        return {"text": desc, "tokens": len(ids),
                "method": "key offset = mean key per (layer, KV head, channel) after RoPE"
                          + (" and the rotation" if model.scheme.rotate else "") + "; int4 levels fixed (INT4_LEVELS)"}
    return {"text": desc, "tokens": len(ids), **calibrate_static(model, ref, ids)}


def calibration_ids(src: Source, calib_text: str | None, calib_tokens: int) -> tuple[list[int], str]:
    """The calibration text's token ids (at most calib_tokens) and what the text is."""
    from tokenizers import Tokenizer

    from export.calibrate import calibration_text

    text, desc = calibration_text(calib_text)
    ids = Tokenizer.from_str(src.tokenizer_json).encode(text, add_special_tokens=False).ids[:calib_tokens]
    if len(ids) < 64:
        raise ExportError(f"calibration text too short: {len(ids)} tokens (need at least 64)")
    return ids, desc


def _write_manifest(folder: Path, manifest: dict) -> None:
    files = [f for f in sorted(folder.iterdir()) if f.name != MANIFEST]
    manifest["files"]["sizes"] = {f.name: f.stat().st_size for f in files}
    manifest["files"]["sha256"] = {f.name: file_sha256(f) for f in files}  # `edgekv verify` checks them
    write_text(folder / MANIFEST, json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")


def build_manifest(src: Source, recipe: dict, kv: str, dtype: str, max_context: int, folder: Path) -> dict:
    from export.onnx_export import window_fields

    cfg = src.config
    scheme = get_scheme(kv)
    names = io_names(cfg.n_layers, scheme, bool(cfg.local_layers))
    int4 = {"int4_levels": list(INT4_LEVELS), "int4_group": INT4_GROUP, "rotation": "hadamard" if scheme.rotate else None} \
        if scheme.kind == "packed4" else {}
    return {
        "format_version": manifest_version(cfg.local_layers),
        "exporter": {"edgekv_version": edgekv.__version__, "torch": torch.__version__, "onnx": onnx.__version__,
                     "source_key": exporter_source_key(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "name": recipe["name"],
        "source": {"kind": src.kind, "file": Path(src.path).name, "sha256": src.sha256},
        "model": {"arch": cfg.arch, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                  "intermediate_size": cfg.intermediate_size, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
                  "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta,
                  "rope_scaling": cfg.rope_scaling, "tie_word_embeddings": cfg.tie_word_embeddings,
                  "n_params": sum(int(np.prod(v.shape)) for v in src.state_dict.values()), **window_fields(cfg)},
        "dtype": dtype,
        "max_context": max_context,
        "kv": {"scheme": kv, "description": scheme.description,
               "tensors": [{"suffix": t.suffix, "dtype": t.dtype, "last_dim": t.last or None} for t in scheme.tensors],
               "layout": "slot-major [P, B, Hkv, D]; scales [P, B, Hkv]", **int4,
               "bytes_per_token": scheme.bytes_per_token(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                                                         2 if dtype == "float16" else 4)},
        "io": names,
        "files": {"onnx": "model.onnx", "tokenizer": "tokenizer.json"},
        "trt_check": {TRT_TARGET: "pass"},
        "special": src.special,
        "chat_template": src.chat_template,
        "defaults": recipe.get("defaults", {}),
    }


def cmd_export(args) -> int:
    """`edgekv export` (edgekv/cli.py dispatches here by name)."""
    export_bundle(args.model, kv=args.kv, out=args.out, max_context=args.max_context, dtype=args.dtype,
                  steps=args.steps, threads=args.threads, calib_text=args.calib_text, calib_tokens=args.calib_tokens,
                  force=args.force, weights=args.weights, group=args.group, method=args.requant_method,
                  requantize=args.requantize)
    return 0
