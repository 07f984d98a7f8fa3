"""The graph file an export writes: torch.export to ONNX, identical initializers stored once, and
the checks it must pass before anything else is written (onnx.checker, TensorRT's parser rules)."""
from __future__ import annotations

from pathlib import Path

import onnx

from edgekv.errors import ExportError, note
from edgekv.format.trt_rules import check_as_built
from edgekv.runtime.backends.engines import tensorrt_graph
from edgekv.tools.progress import stage
from export.model import Transformer

TRT_TARGET = "10.3"  # JetPack 6's TensorRT: every bundle must pass its parser rules


def write_graph(model: Transformer, plan: dict, folder: Path, dtype: str) -> None:
    """folder/model.onnx (+ its weights file), checked; an ExportError if it breaks a rule."""
    kv = model.scheme.name
    with stage("exporting ONNX", f" (kv={kv}, dtype={dtype}; torch.export: the slowest step)"):
        from export.onnx_export import export_onnx, save_onnx

        proto = export_onnx(model, plan)
        save_onnx(proto, folder / "model.onnx")
        del proto
        store_identical_once(folder / "model.onnx")
    with stage("checking the graph", " (onnx.checker full, TensorRT parser rules)"):
        onnx.checker.check_model(str(folder / "model.onnx"), full_check=True)
        violations, converted = check_as_built(folder / "model.onnx", TRT_TARGET, tensorrt_graph)
    if violations:
        for v in violations[:10]:
            note(f"  ✗ TensorRT {TRT_TARGET}: {v}")
        raise ExportError(f"the graph breaks {len(violations)} TensorRT {TRT_TARGET} parser rule(s); nothing written")
    note(f"  ✓ TensorRT {TRT_TARGET} parser rules (edgekv check-trt)"
         + (f"; {len(converted)} 8-bit block-wise weight(s) go per channel at engine build" if converted else ""))


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
