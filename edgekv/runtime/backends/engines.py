"""TensorRT engines of a bundle: where they are cached and the shapes they are built for.

An engine is specific to a GPU, a TensorRT version and the shapes of its optimization profiles,
so it lives under `BUNDLE/engines/<gpu>-trt<version>-ctx<N>-p<M>/` with `model.plan` and
`engine.json` (what it was built from). Pure Python: the runtime (edgekv/runtime/backends/trt.py) finds
engines with it and jetson/build_engine.py builds them; the profile shapes are tested here
against the graph's inputs without TensorRT.

The graph TensorRT parses is the bundle's with one change (`tensorrt_graph`): TensorRT takes
block-wise DequantizeLinear only for INT4, so 8-bit block-wise weights (a GGUF's Q8_0 head, kept
exactly for onnxruntime) are requantized per output channel at engine build.

Two profiles, because decode and prefill want different kernels:
  0 decode:  S = 1, one logits row, past length P from 0 to ctx
  1 prefill: S from 1 to max_prefill (optimized for max_prefill), K rows up to max_prefill, P from 0 to ctx
(P reaches ctx when a shared pool of cells is full to its last cell and a call writes into a
freed run below it: `edgekv serve`.)
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from edgekv.format.bundle import LOCAL_MASK, MANIFEST, Bundle
from edgekv.format.files import make_folders, replace_dir, temp_dir, write_bytes, write_text
from edgekv.format.trt_graph import block_size
from edgekv.graph.passes.trt_staging import stage_weights

DECODE, PREFILL = 0, 1
PLAN, META = "model.plan", "engine.json"
PROFILES_VERSION = 2  # 2: the past reaches ctx (a full pool or ring); an engine built for 1 is rebuilt


def _family(gpu: str, trt_version: str) -> str:
    """The part of an engine's key that must match exactly: GPU and TensorRT version."""
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"
    return f"{slug}-trt{trt_version}"


def engine_key(gpu: str, trt_version: str, ctx: int, max_prefill: int) -> str:
    return f"{_family(gpu, trt_version)}-ctx{ctx}-p{max_prefill}"


def bundle_fingerprint(bundle: Bundle) -> str:
    """Changes whenever the bundle is re-exported (the manifest records the graph's checksum and sizes)."""
    return hashlib.sha256((bundle.path / MANIFEST).read_bytes()).hexdigest()[:16]


def profile_shapes(bundle: Bundle, ctx: int, max_prefill: int) -> list[dict[str, tuple[tuple, tuple, tuple]]]:
    """Per profile: graph input -> (min, opt, max) shape."""
    m = bundle.model
    hkv, d = m["n_kv_heads"], m["head_dim"]
    max_prefill = min(max_prefill, ctx)
    past_specs = {name: bundle.scheme.spec_of(name) for name in bundle.manifest["io"]["past"]}

    def profile(s: tuple, k: tuple, p: tuple) -> dict:
        shapes = {
            "input_ids": tuple((1, x) for x in s),
            "position_ids": tuple((1, x) for x in s),
            "logits_index": tuple((1, x) for x in k),
            "key_mask": tuple((1, b, a + b) for a, b in zip(p, s)),
        }
        if LOCAL_MASK in bundle.manifest["io"]["inputs"]:  # the sliding-window layers' mask: key_mask's shape
            shapes[LOCAL_MASK] = shapes["key_mask"]
        for name, spec in past_specs.items():
            shapes[name] = tuple(spec.shape(x, 1, hkv, d) for x in p)
        return shapes

    opt_past = ctx // 2
    decode = profile(s=(1, 1, 1), k=(1, 1, 1), p=(0, opt_past, ctx))
    prefill = profile(s=(1, max_prefill, max_prefill), k=(1, 1, max_prefill),
                      p=(0, min(opt_past, ctx - max_prefill), ctx))
    # key_mask is [1, S, P + S] at every corner, so the three boxes agree with the graph's own shape
    # arithmetic; the runtime never binds P + S beyond its capacity
    return [decode, prefill]


def engine_dir(bundle: Bundle, key: str) -> Path:
    return bundle.path / "engines" / key


def is_fresh(folder: Path, bundle: Bundle) -> bool:
    meta = folder / META
    if not (folder / PLAN).is_file() or not meta.is_file():
        return False
    try:
        info = json.loads(meta.read_text())
    except json.JSONDecodeError:
        return False
    return (info.get("bundle_fingerprint") == bundle_fingerprint(bundle)
            and info.get("profiles_version", 1) == PROFILES_VERSION)


def find_engine(bundle: Bundle, gpu: str, trt_version: str, ctx: int) -> tuple[Path, dict] | None:
    """The fresh engine for this GPU and TensorRT whose profiles cover a `ctx`-slot cache
    (the smallest such one), or None."""
    best = None
    for folder in sorted((bundle.path / "engines").glob(_family(gpu, trt_version) + "-ctx*")):
        if not is_fresh(folder, bundle):
            continue
        info = json.loads((folder / META).read_text())
        if info["ctx"] >= ctx and (best is None or info["ctx"] < best[1]["ctx"]):
            best = (folder, info)
    return best


def write_engine(folder: Path, plan: bytes, meta: dict) -> None:
    """Put a built engine at `folder`: its plan and META written to a temporary folder beside it
    (a killed build's leftovers removed first, the free space checked for the plan: a full disk is
    one line naming the folder and the bytes), then renamed in place of the old one (ours: deleted)."""
    make_folders(folder.parent)
    with temp_dir(folder, len(plan) + 4096) as tmp:
        write_bytes(tmp / PLAN, plan)
        write_text(tmp / META, json.dumps(meta, indent=1))
        replace_dir(tmp, folder)


# -- the graph as TensorRT gets it ---------------------------------------------------------------

OPSET_WITHOUT_INT4 = 20  # the highest opset TensorRT 10.3's documents name (docs/tensorrt.md)


def tensorrt_graph(model, folder: Path) -> list[str]:
    """Rewrite `model` (loaded without its weights; they are read from `folder` only when needed)
    in place into what TensorRT's parser accepts: staged (trt_graph.stage_weights: fp16 block
    scales widened, packed codes unpacked), then per_channel. Returns the converted weights' names."""
    stage_weights(model, folder)
    return per_channel(model, folder)


def per_channel(model, folder: Path) -> list[str]:
    """In a staged graph, every block-wise DequantizeLinear of an INT8 constant made per output
    channel (axis 1, scale [N] = the column's absmax / 127, codes requantized from the block
    values: within half a per-channel step of them), and a graph left without INT4 dropped back
    from opset 21. Returns the converted weights' names."""
    import onnx
    from onnx import TensorProto, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    todo = [n for n in g.node if n.op_type == "DequantizeLinear" and block_size(n) > 0
            and n.input[0] in inits and inits[n.input[0]].data_type == TensorProto.INT8]
    if not todo:
        return []
    onnx.load_external_data_for_model(model, str(folder))
    for n in todo:
        codes = numpy_helper.to_array(inits[n.input[0]])  # [K, N]
        scales = numpy_helper.to_array(inits[n.input[1]])  # [K / B, N]
        b = block_size(n)
        k, cols = codes.shape
        w = (codes.reshape(k // b, b, cols).astype(np.float64) * scales.astype(np.float64)[:, None, :]).reshape(k, cols)
        s = np.maximum(np.abs(w).max(0), 1e-12) / 127.0  # [N]
        q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
        inits[n.input[0]].CopyFrom(numpy_helper.from_array(q, n.input[0]))
        inits[n.input[1]].CopyFrom(numpy_helper.from_array(s.astype(scales.dtype), n.input[1]))
        keep = [a for a in n.attribute if a.name not in ("axis", "block_size")]
        del n.attribute[:]
        n.attribute.extend(keep + [onnx.helper.make_attribute("axis", 1)])
    still_blocked = any(n.op_type == "DequantizeLinear" and block_size(n) > 0 for n in g.node)
    if not still_blocked and not any(i.data_type == TensorProto.INT4 for i in g.initializer):
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = min(o.version, OPSET_WITHOUT_INT4)
    return [n.input[0] for n in todo]
