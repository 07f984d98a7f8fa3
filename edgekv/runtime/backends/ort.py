"""The onnxruntime backends (edgekv/runtime/backends/base.py has the protocol they follow):
ort-cpu (host memory) and ort-cuda (the KV buffers are device memory bound by address)."""
from __future__ import annotations

import numpy as np

from edgekv.errors import BackendUnavailable, BundleError, EdgeKVError
from edgekv.format.bundle import Bundle
from edgekv.runtime.backends.base import UNLIMITED
from edgekv.runtime.cache import KVCache
from edgekv.runtime.memory import HostMemory, KVMemory
from edgekv.runtime.sequence import Sequence


def _import_ort():
    try:
        import onnxruntime as ort
    except ImportError:
        raise BackendUnavailable("onnxruntime is not installed: pip install onnxruntime "
                                 "(onnxruntime-gpu for ort-cuda)") from None
    return ort


# session.qdq_matmulnbits_accuracy_level: the activations of the fused MatMulNBits that quantized
# weights run as (docs/weights.md): 4 = int8 (llama.cpp's choice), 0 = float32 (the exporter's exact parity)
MATMUL_ACCURACY = 4


class OrtBackend:
    """onnxruntime with IOBinding; the CPU provider (subclassed for CUDA)."""
    name = "ort-cpu"
    device = "cpu"
    runs_ring = True  # onnxruntime runs the ring's aliased past/present (the aliased slots are masked)
    max_tokens_per_call = UNLIMITED

    def __init__(self, bundle: Bundle, threads: int | None = None, max_logits_rows: int = 1,
                 matmul_accuracy: int = MATMUL_ACCURACY):
        ort = self.ort = _import_ort()
        self.check_available(ort)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or 0
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        # onnxruntime caches a memory plan per input shape; the past length changes every step, so
        # that cache only grows and is never reused (docs/graph.md)
        opts.enable_mem_pattern = False
        # quantized weights: DequantizeLinear -> MatMul runs fused as MatMulNBits
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(matmul_accuracy))
        if not bundle.onnx_path.is_file():
            raise BundleError(f"{bundle.path}: corrupt bundle ({bundle.onnx_path.name} is missing)")
        try:
            self.session = ort.InferenceSession(str(bundle.onnx_path), opts, providers=self.providers())
        except Exception as e:  # onnxruntime raises its own exception types for a bad file
            msg = str(e).splitlines()[0][:200]
            raise BundleError(f"{bundle.path}: corrupt bundle (onnxruntime cannot load {bundle.onnx_path.name}: {msg})") from None
        self.check_session()
        self.vocab = bundle.model["vocab_size"]
        self.io = self.session.io_binding()
        self.logits = np.empty((1, max(1, max_logits_rows), self.vocab), np.float32)
        graph_inputs = {i.name for i in self.session.get_inputs()}
        expected = set(bundle.manifest["io"]["inputs"]) | set(bundle.manifest["io"]["past"])
        if graph_inputs != expected:
            raise BundleError(f"{bundle.path}: corrupt bundle (graph inputs do not match the manifest)")
        self.memory = self.make_memory()

    # -- what differs between providers
    def check_available(self, ort) -> None:
        pass

    def providers(self) -> list:
        return ["CPUExecutionProvider"]

    def check_session(self) -> None:
        pass

    def make_memory(self) -> KVMemory:
        return HostMemory()

    def close(self) -> None:
        pass  # onnxruntime frees its session and the host buffers with the objects

    def _ensure_logits(self, b: int, k: int) -> np.ndarray:
        if self.logits.shape[0] < b or self.logits.shape[1] < k:
            self.logits = np.empty((max(b, self.logits.shape[0]), max(k, self.logits.shape[1]), self.vocab), np.float32)
        # a contiguous [b, k, V] block at the start of the buffer
        return self.logits.reshape(-1)[: b * k * self.vocab].reshape(b, k, self.vocab)

    def run(self, cache: KVCache, seq: Sequence, input_ids: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        if cache.memory.device != self.device:
            raise EdgeKVError(f"{self.name} needs its KV cache in {self.device} memory (build it with memory=backend.memory)")
        io = self.io
        b, s = input_ids.shape
        n, w = seq.n, seq.w  # past = the n filled slots; present goes to slots w..w+s
        # the small inputs and the logits stay on the host; onnxruntime moves them if it must
        io.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, np.int64))
        io.bind_cpu_input("position_ids", seq.positions(s))
        io.bind_cpu_input("logits_index", np.ascontiguousarray(logits_index, np.int64))
        mask = seq.key_mask(s)
        io.bind_input("key_mask", "cpu", 0, np.bool_, list(mask.shape), mask.ctypes.data)
        for name in cache.names:
            dt = cache.dtypes[name]
            # past: only the filled prefix, so cost follows the context, not the capacity
            io.bind_input(name, self.device, 0, dt, cache.slots_shape(name, n), cache.ptr(name, 0))
            # present: the new tokens' slots, so the graph writes the cache in place
            io.bind_output("present" + name[4:], self.device, 0, dt, cache.slots_shape(name, s), cache.ptr(name, w))
        logits = self._ensure_logits(b, logits_index.shape[1])
        io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(io)
        return logits


class OrtCudaBackend(OrtBackend):
    """onnxruntime's CUDA provider; the KV buffers are device memory bound by address."""
    name = "ort-cuda"
    device = "cuda"

    def check_available(self, ort) -> None:
        have = ort.get_available_providers()
        if "CUDAExecutionProvider" not in have:
            raise BackendUnavailable(f"ort-cuda needs onnxruntime-gpu (this onnxruntime {ort.__version__} offers "
                                     f"{', '.join(p.replace('ExecutionProvider', '') for p in have)}): pip install "
                                     "onnxruntime-gpu (on a Jetson: the JetPack wheel from jetson-ai-lab.com)")

    def providers(self) -> list:
        return [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]

    def check_session(self) -> None:
        # onnxruntime falls back to the CPU silently when CUDA's libraries or a GPU are missing
        if self.session.get_providers()[0] != "CUDAExecutionProvider":
            raise BackendUnavailable("ort-cuda: onnxruntime could not start its CUDA provider (no GPU, or CUDA/cuDNN "
                                     "libraries missing; `python -m jetson.env_check` shows what is there)")

    def make_memory(self) -> KVMemory:
        from edgekv.runtime.backends.gpu import OrtValueMemory
        return OrtValueMemory(self.ort, "cuda")
