"""The tests' cache of torch.onnx traces across runs (not in CI): a run that changes no exporter
source reuses the graphs the last run traced, as ccache reuses objects. A trace is ~5 CPU-s of a
tiny model (torch.export's symbolic shapes), ~36 % of a run's CPU (docs/tests.md).

The key is everything a trace depends on except the values of the model's parameters and buffers:
the exporter's sources and library versions (export/manifest.py's exporter_source_key, which also
decides when the tests reuse the real bundle), onnxscript's, onnx_ir's and Python's versions,
torch's default dtype, and the model's structure (every module's type, its parameters' and
buffers' names, shapes and dtypes, its other attributes: config, scheme, flags; a tensor kept as
a plain attribute by its bytes). An attribute whose repr varies between processes (an address)
only makes the key miss. A hit is the stored graph with each initializer that is one of the
model's tensors set from the model itself; the graph is byte for byte the one a fresh trace
writes (tests/test_trace_cache.py; EDGEKV_TRACE_CACHE=verify traces afresh beside every hit and
compares them, over a whole run). CI=1 (a clean run) always traces.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import numpy as np


def structure_key(model) -> str:
    """A hash of what a trace of `model` depends on besides its tensors' values."""
    import torch

    h = hashlib.sha256(f"default dtype {torch.get_default_dtype()}\n".encode())
    first: dict = {}  # which tensors are one (a tied head): torch.export keeps one initializer for them
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        h.update(f"{name} is {first.setdefault(id(t), name)}, shares memory with "
                 f"{first.setdefault(('data', t.data_ptr()), name)}\n".encode())
    for name, mod in model.named_modules(remove_duplicate=False):
        h.update(f"[{name}] {type(mod).__module__}.{type(mod).__qualname__}\n".encode())
        for k, v in sorted(vars(mod).items()):
            if k in ("_parameters", "_buffers"):
                for n, t in v.items():
                    h.update(f"{k} {n} {None if t is None else (tuple(t.shape), t.dtype)}\n".encode())
            elif k == "_modules" or (k.endswith("_hooks") or "_hooks_" in k) and not v:
                continue
            elif isinstance(v, (set, frozenset)):  # a set's order follows string hashing: per process
                h.update(f"{k} {sorted(map(repr, v))}\n".encode())
            elif isinstance(v, torch.Tensor):
                h.update(f"{k} tensor {tuple(v.shape)} {v.dtype}\n".encode() + v.detach().cpu().numpy().tobytes())
            else:
                h.update(f"{k} {v!r}\n".encode())
    return h.hexdigest()[:24]


def code_key() -> str:
    """The part of the key that is the same for every model of a run: the exporter's sources, the
    libraries' versions and this file (how entries are stored and read)."""
    import onnx_ir
    import onnxscript

    from export.manifest import exporter_source_key

    versions = f"onnxscript {onnxscript.__version__} onnx_ir {onnx_ir.__version__} python {sys.version}"
    own = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return f"{exporter_source_key()} {versions} {own}"


def cache_key(model, code: str | None = None) -> str:
    code = code_key() if code is None else code
    return hashlib.sha256(f"{code} {structure_key(model)}".encode()).hexdigest()[:24]


def _tensors(model) -> dict:
    """The model's tensors by every name a graph of it may give them: a model with local layers is
    traced inside LocalMaskGraph, which holds it as `model` (export/onnx_export.py)."""
    own = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    return own | {f"model.{k}": v for k, v in own.items()}


def _module_code() -> dict:
    """What a trace runs besides the model's instance state, by identity: export.model's and the
    exporter's globals and their classes' attributes (a test's monkeypatch changes them)."""
    import export.model
    import export.onnx_export
    import edgekv.format.kvschemes

    out = {}
    for mod in (export.model, export.onnx_export, edgekv.format.kvschemes):
        for k, v in vars(mod).items():
            if k == "_trace":  # this cache's own wrapper (and a test's around it)
                continue
            out[(mod.__name__, k)] = id(v)
            if isinstance(v, type) and v.__module__ == mod.__name__:
                out.update({(mod.__name__, k, a): id(b) for a, b in vars(v).items()})
    return out


class CachedTrace:
    """What the exporter reads of torch's ONNXProgram: `.model` (onnx_ir) and `.model_proto`."""

    def __init__(self, model_ir):
        self.model = model_ir

    @property
    def model_proto(self):
        from onnxscript import ir

        return ir.serde.serialize_model(self.model)


def store(path: Path, program, model) -> None:
    """The traced graph without the data of the model's own tensors (they come from the model on
    a hit), written whole or not at all (workers may store the same trace at once)."""
    proto = program.model_proto
    own = _tensors(model)
    for init in proto.graph.initializer:
        if init.name in own:
            init.ClearField("raw_data")
            for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                init.ClearField(f)
        elif len(init.raw_data) > 4096:  # a weight under a name not the model's: not reused
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(proto.SerializeToString())
    os.replace(tmp, path)


def load(path: Path, model) -> CachedTrace | None:
    """The stored graph with the model's tensors set in, or None where it does not fit them."""
    import onnx
    from onnxscript import ir

    proto = onnx.load_from_string(path.read_bytes())
    own = _tensors(model)
    for init in proto.graph.initializer:  # one emptied when stored must be the model's now
        empty = not (init.raw_data or init.float_data or init.int32_data or init.int64_data or init.double_data)
        if init.name not in own and empty and int(np.prod(init.dims)) > 0:
            return None
    graph = ir.serde.deserialize_model(proto)
    if not graph.graph.inputs or not graph.graph.outputs:  # a file cut short
        return None
    for name, init in graph.graph.initializers.items():
        t = own.get(name)
        if t is None:
            continue
        array = t.detach().cpu().numpy()
        if tuple(init.shape) != array.shape or init.dtype != ir.DataType.from_numpy(array.dtype):
            return None
        init.const_value = ir.Tensor(np.ascontiguousarray(array), name=name)
    return CachedTrace(graph)


def cached(trace, folder: Path, verify: bool = False):
    """`trace` (export/onnx_export._trace) through the cache in `folder`."""
    code, key = _module_code(), code_key()  # once: the sources a run traces with

    def traced(model):
        from torch.nn.modules import module as torch_module

        hooks = torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
        if hooks or _module_code() != code:  # a test patched what the trace runs: trace it, keep nothing
            return trace(model)
        path = folder / f"{cache_key(model, key)}.onnx"
        try:
            hit = load(path, model) if path.is_file() else None
        except Exception:  # a damaged file (an interrupted run's) is a miss
            hit = None
        if hit is None:
            program = trace(model)
            try:
                store(path, program, model)
            except OSError:  # a read-only checkout: the run traces, as with no cache
                pass
            return program
        if verify:
            fresh = trace(model).model_proto.SerializeToString()
            if hit.model_proto.SerializeToString() != fresh:
                raise AssertionError(f"trace cache: {path.name} differs from a fresh trace")
        return hit
    traced.__wrapped__ = trace
    return traced
