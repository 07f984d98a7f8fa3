"""The manifest (edgekv.json) an export writes: the model, the KV scheme, the I/O names, the
weights' storage per matrix, the files with their sizes and sha256, and the exporter's source key."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx
import torch

import edgekv
from edgekv.format.bundle import MANIFEST, file_sha256, io_names, manifest_version
from edgekv.format.files import write_text
from edgekv.format.kvschemes import INT4_GROUP, INT4_LEVELS, get_scheme
from export.graph_file import TRT_TARGET
from export.source import Source
from export.model_sampling import manifest_sampling
from export.weights import stored_bytes, summary


# what decides a bundle's contents: the exporter, the format, scheme and TensorRT parser-rule
# definitions (edgekv/format/trt_rules.py), the recipes (and, below, the torch and onnx versions)
SOURCE_GLOBS = ("export/*.py", "edgekv/format/*.py", "edgekv/data/*.json", "models/*.json")


def exporter_source_key(root: Path | None = None) -> str:
    """A hash of everything that decides what a bundle holds. The manifest records it, so a bundle
    made by other code (an older exporter) can be told apart and not reused by the tests."""
    import hashlib

    root = root or Path(__file__).resolve().parent.parent
    h = hashlib.sha256(f"torch {torch.__version__} onnx {onnx.__version__}\n".encode())
    for f in sorted({f for g in SOURCE_GLOBS for f in root.glob(g)}):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


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


def write_manifest(folder: Path, manifest: dict) -> None:
    files = [f for f in sorted(folder.iterdir()) if f.name != MANIFEST]
    manifest["files"]["sizes"] = {f.name: f.stat().st_size for f in files}
    manifest["files"]["sha256"] = {f.name: file_sha256(f) for f in files}  # `edgekv verify` checks them
    write_text(folder / MANIFEST, json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")


def build_manifest(src: Source, recipe: dict, kv: str, dtype: str, max_context: int) -> dict:
    from export.onnx_export import window_fields, windowed_kv_fields

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
                                                         2 if dtype == "float16" else 4),
               **windowed_kv_fields(cfg, scheme, 2 if dtype == "float16" else 4)},
        "io": names,
        "files": {"onnx": "model.onnx", "tokenizer": "tokenizer.json"},
        "trt_check": {TRT_TARGET: "pass"},
        "special": src.special,
        "chat_template": src.chat_template,
        "defaults": recipe.get("defaults", {}),
        # what a request that sets no sampling gets; editable (the manifest is not among the hashed files)
        "sampling": manifest_sampling(src.sampling, recipe),
    }
