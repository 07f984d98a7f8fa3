"""Backends: which one runs here (`make_backend`, `auto`). The backends themselves: ort.py
(ort-cpu; ort_cuda.py: ort-cuda), each a list of graph passes (edgekv/graph/) plus a session, its
calls plain.py's (the graph as written) or fused.py's (the fused graph); trt.py (a TensorRT
engine); their device memory: gpu.py."""
from __future__ import annotations

import os

from edgekv.errors import BackendUnavailable, BundleError, EdgeKVError
from edgekv.format.bundle import Bundle
from edgekv.runtime.backends.base import Backend
from edgekv.runtime.backends.ort import MATMUL_ACCURACY, OrtBackend
from edgekv.runtime.backends.ort_cuda import OrtCudaBackend
from edgekv.runtime.cache import default_capacity

BACKENDS = ("auto", "ort-cpu", "ort-cuda", "trt")
# the native packages each backend loads (absent ones are the backend's own one-line error later)
ORT_MODULES = ("onnxruntime", "onnx")
TRT_MODULES = ("tensorrt", "cuda.bindings.runtime")
NATIVE_MODULES = {"ort-cpu": ORT_MODULES, "ort-cuda": ORT_MODULES, "trt": TRT_MODULES,
                  "auto": TRT_MODULES + ORT_MODULES}


def import_native(name: str) -> None:
    """Import the native packages backend `name` will load, where installed, with SIGINT and SIGTERM
    held until they are in. An exception raised inside an extension module's own initialization
    (Ctrl-C's KeyboardInterrupt, serve's Stop) leaves it half made: pybind11 reports an ImportError
    ("onnxruntime is not installed", or `auto` quietly falling back), nanobind aborts, or a later
    import of onnx crashes. Held, the first signal is raised again once the imports are done, where
    its own handler runs. (Masking the signal is not enough: another thread receives it and Python
    runs the handler on the main thread all the same.)"""
    import importlib
    import signal
    import threading

    came: list[int] = []
    old = {}
    if threading.current_thread() is threading.main_thread():  # only the main thread sets handlers
        old = {s: signal.signal(s, lambda signum, frame: came.append(signum))
               for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for module in NATIVE_MODULES.get(name, ()):
            try:
                importlib.import_module(module)
            except ImportError:
                pass
    finally:
        for s, handler in old.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    if came:
        signal.raise_signal(came[0])


def make_backend(name: str, bundle: Bundle, threads: int | None = None, max_logits_rows: int = 1,
                 ctx: int | None = None, log=None, matmul_accuracy: int = MATMUL_ACCURACY,
                 attention: str | None = None) -> Backend:
    """The backend `name`, or for `auto` the best one that works here: trt when a built engine
    covers `ctx`, else ort-cuda when onnxruntime has CUDA, else ort-cpu. `log` gets one line
    saying why a better backend was passed over. `matmul_accuracy`, `attention`: OrtBackend's
    (attention None: EDGEKV_ATTENTION's choice)."""
    import_native(name)
    if name == "ort-cpu":
        return check_graph(OrtBackend(bundle, threads, max_logits_rows, matmul_accuracy=matmul_accuracy,
                                      attention=attention), bundle)
    if name == "ort-cuda":
        return check_graph(OrtCudaBackend(bundle, threads, max_logits_rows, matmul_accuracy=matmul_accuracy,
                                      attention=attention), bundle)
    if name == "trt":
        from edgekv.runtime.backends.trt import TrtBackend
        return TrtBackend(bundle, ctx or default_capacity(bundle), max_logits_rows)
    if name != "auto":
        raise EdgeKVError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    skipped = []
    for cand in ("trt", "ort-cuda"):
        try:
            return make_backend(cand, bundle, threads, max_logits_rows, ctx, matmul_accuracy=matmul_accuracy,
                                attention=attention)
        except BackendUnavailable as e:
            skipped.append(str(e))
    if log and skipped and _looks_like_gpu_box():
        for why in skipped:
            log(f"auto backend: {why}")
    return check_graph(OrtBackend(bundle, threads, max_logits_rows, matmul_accuracy=matmul_accuracy,
                                      attention=attention), bundle)


# numpy dtype name -> onnxruntime's type string of a graph input
ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int8": "tensor(int8)", "uint8": "tensor(uint8)"}


def check_graph(backend: OrtBackend, bundle: Bundle) -> OrtBackend:
    """The graph says what the manifest says: the logits' vocabulary, and each cache input's dtype
    from the KV scheme and the bundle's dtype (a manifest edited or mixed up with another graph
    fails here with one line, not in the middle of a call)."""
    session = backend.session
    where = f"{bundle.path}: corrupt bundle"
    logits = {o.name: o for o in session.get_outputs()}.get("logits")
    vocab = bundle.model["vocab_size"]
    dim = logits.shape[-1] if logits is not None and logits.shape else None
    if logits is None or (isinstance(dim, int) and dim != vocab):  # a named (dynamic) dim is not checked
        raise BundleError(f"{where} (the graph's logits have {dim} entries per token, the manifest's "
                          f"vocab_size is {vocab})")
    for i in session.get_inputs():
        if i.name.startswith("past."):
            spec = bundle.scheme.spec_of(i.name)
            want = ORT_TYPES.get(bundle.dtype if spec.dtype == "float" else spec.dtype)
            if i.type != want:
                raise BundleError(f"{where} ({i.name} is {i.type} in the graph; the manifest's KV scheme "
                                  f"{bundle.scheme.name} and dtype {bundle.dtype} need {want})")
    return backend


def _looks_like_gpu_box() -> bool:
    """Only say why the GPU backends were skipped where a GPU seems to exist."""
    return os.path.exists("/dev/nvidia0") or os.path.exists("/etc/nv_tegra_release")
