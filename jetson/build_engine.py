"""Build a bundle's TensorRT engine on the device: `edgekv build-engine BUNDLE [--ctx N] [--max-prefill N]`.

- Strongly typed network: the graph's own types decide precision (an fp16 bundle builds fp16
  kernels; the INT8 cache enters through the unit-scale Q/DQ pairs of docs/graph.md).
- Two optimization profiles (edgekv/runtime/backends/engines.py): decode (S = 1) and prefill (S up to
  --max-prefill), both with the past length from 0 to the capacity.
- Cached under BUNDLE/engines/<gpu>-trt<version>-ctx<N>-p<M>/ and rebuilt only when the bundle
  changed (or with --force); written to a temporary folder first, then renamed.
- Memory is checked before building: an Orin shares its memory between CPU and GPU, and a
  build that runs out of it can take the whole board down with it.

Needs TensorRT's Python package and cuda-python (JetPack provides both). Not runnable on the
development machines of this project (no TensorRT there); jetson/selftest.sh runs it."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from edgekv.errors import EdgeKVError, note
from edgekv.format.bundle import load_bundle
from edgekv.format.files import make_folders, temp_dir
from edgekv.graph.passes.trt_staging import stage_weights
from edgekv.runtime.backends.engines import (PLAN, PROFILES_VERSION, bundle_fingerprint, engine_dir, engine_key, is_fresh,
                                             per_channel, profile_shapes, write_engine)
from edgekv.runtime.backends.gpu import check, cudart
from edgekv.runtime.backends.trt import gpu_name, import_tensorrt
from edgekv.runtime.cache import default_capacity
from edgekv.runtime.memory import available_memory


def memory_needed(bundle, ctx: int, workspace: int) -> int:
    """A rough ceiling for the build: weights held by the parser and by the builder, the KV cache
    of the largest profile, and the tactic workspace."""
    return 2 * bundle.graph_bytes() + bundle.kv_bytes_per_token() * ctx + workspace


def free_memory(rt) -> int:
    free_gpu, _ = check(rt.cudaMemGetInfo())
    host = available_memory()  # on an Orin the GPU's memory is the system's: the smaller one counts
    return min(int(free_gpu), host) if host is not None else int(free_gpu)


def parse(trt, parser, bundle, scratch: Path) -> None:
    """Parse the bundle's graph as TensorRT takes it: the file itself, or, when it holds fp16 block
    scales or 8-bit block-wise weights, its rewrite (engines.tensorrt_graph: the scales widened,
    the 8-bit weights per channel) written to `scratch`."""
    import onnx

    path = bundle.onnx_path
    model = onnx.load(str(path), load_external_data=False)
    staged = stage_weights(model, path.parent)  # tensorrt_graph in two steps: to know whether either changed it
    converted = per_channel(model, path.parent)
    if converted:
        note(f"  {len(converted)} 8-bit block-wise weight(s) requantized per output channel for TensorRT")
    if staged or converted:
        path = scratch / "model.onnx"
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=1024)
    del model
    if not parser.parse_from_file(str(path)):  # reads the external weights beside it
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise EdgeKVError("TensorRT could not parse the graph: " + (errors[0] if errors else "unknown error")
                          + ("" if len(errors) < 2 else f" (+{len(errors) - 1} more)")
                          + f"; `edgekv check-trt {bundle.path} --trt {trt.__version__[:4]}` names the nodes")


def _build(trt, bundle, gpu: str, key: str, ctx: int, max_prefill: int, workspace: int, scratch: Path):
    """Parse, set the two profiles, build: (the serialized plan, the profiles, seconds)."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    note(f"parsing {bundle.onnx_path} ({bundle.scheme.name}, {bundle.dtype}) with TensorRT {trt.__version__} on {gpu}")
    parse(trt, parser, bundle, scratch)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
    profiles = profile_shapes(bundle, ctx, max_prefill)
    for shapes in profiles:
        prof = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            prof.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(prof)

    note(f"building {key} (decode + prefill profiles; several minutes on an Orin) ...")
    done = threading.Event()
    t0 = time.time()

    def ticker():  # the build is one blocking call: show that it is alive
        while not done.wait(15):
            note(f"  ... {time.time() - t0:.0f} s")

    threading.Thread(target=ticker, daemon=True).start()
    try:
        plan = builder.build_serialized_network(network, config)
    finally:
        done.set()
    if plan is None:
        raise EdgeKVError("TensorRT failed to build the engine (its messages are above); if it ran out of memory, "
                          "use a smaller --ctx / --max-prefill / --workspace-mib")
    return plan, profiles, time.time() - t0


def build_engine(bundle_path: str, ctx: int | None = None, max_prefill: int = 256, workspace_mib: int = 1024,
                 force: bool = False) -> Path:
    bundle = load_bundle(bundle_path)
    trt = import_tensorrt()
    rt = cudart()
    ctx = ctx or default_capacity(bundle)
    if ctx > bundle.max_context:
        raise EdgeKVError(f"a {ctx}-slot cache exceeds the {bundle.max_context} tokens this bundle was verified for",
                          setting="capacity", fix="use a smaller {}")
    max_prefill = min(max_prefill, ctx)
    gpu = gpu_name(rt)
    key = engine_key(gpu, trt.__version__, ctx, max_prefill)
    folder = engine_dir(bundle, key)
    if not force and is_fresh(folder, bundle):
        note(f"engine up to date: {folder}")
        return folder
    workspace = workspace_mib * 2**20
    need, free = memory_needed(bundle, ctx, workspace), free_memory(rt)
    if need > free:
        raise EdgeKVError(f"building the engine needs about {need / 2**20:.0f} MiB, only {free / 2**20:.0f} MiB free "
                          f"(the GPU shares memory with the CPU on a Jetson): close other programs, or use a "
                          f"smaller --ctx / --workspace-mib")

    make_folders(folder.parent)
    with temp_dir(folder.with_name(key + ".graph")) as scratch:  # killed builds' leftovers removed first
        # a rewritten graph (parse) stays on disk until the engine is built
        plan, profiles, took = _build(trt, bundle, gpu, key, ctx, max_prefill, workspace, scratch)
    write_engine(folder, bytes(plan), {  # a full disk: one line, the old engine kept
        "bundle_fingerprint": bundle_fingerprint(bundle), "profiles_version": PROFILES_VERSION,
        "gpu": gpu, "tensorrt": trt.__version__,
        "ctx": ctx, "max_prefill": max_prefill, "workspace_mib": workspace_mib, "build_s": round(took, 1),
        "profiles": [{n: [list(x) for x in v] for n, v in p.items() if not n.startswith("past.") or n.startswith("past.0.")}
                     for p in profiles],
    })
    note(f"engine written: {folder / PLAN} ({(folder / PLAN).stat().st_size / 2**20:.1f} MiB, built in {took:.0f} s)")
    return folder


def cmd_build_engine(args) -> int:
    build_engine(args.bundle, args.ctx, args.max_prefill, args.workspace_mib, args.force)
    return 0
