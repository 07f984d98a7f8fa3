"""`edgekv check-trt`: a bundle's graph (as the engine build hands it to TensorRT) or a bare .onnx
file held against TensorRT's ONNX parser rules. The rules are the format layer's
(edgekv/format/trt_rules.py, on edgekv/format/trt_graph.py's view of a graph), which the exporter holds every graph to as well."""
from __future__ import annotations

from pathlib import Path

from edgekv.errors import EdgeKVError
from edgekv.format.bundle import load_bundle
from edgekv.format.trt_graph import read_onnx
from edgekv.format.trt_rules import check_as_built, check_model
from edgekv.runtime.backends.engines import tensorrt_graph


def cmd_check_trt(args) -> int:
    p = Path(args.bundle)
    try:
        if p.suffix == ".onnx":  # a bare graph: as it stands (the engine build's rewrite is for bundles)
            path, converted = p, []
            violations = check_model(read_onnx(path), args.trt)
        else:
            path = load_bundle(p).onnx_path
            violations, converted = check_as_built(path, args.trt, tensorrt_graph)
    except ValueError as e:
        raise EdgeKVError(str(e)) from None
    if converted:
        print(f"  {len(converted)} 8-bit block-wise weight(s) checked as the engine build writes them: per output "
              f"channel (TensorRT takes block-wise DequantizeLinear only for INT4)")
    if not violations:
        print(f"✓ {path}: every node passes TensorRT {args.trt}'s ONNX parser rules")
        return 0
    print(f"✗ {path}: {len(violations)} violation(s) of TensorRT {args.trt}'s ONNX parser rules:")
    for v in violations:
        print(f"  {v}")
    return 1
