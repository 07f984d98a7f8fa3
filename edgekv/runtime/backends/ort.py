"""The onnxruntime backends (edgekv/runtime/backends/base.py has the protocol they follow):
ort-cpu (host memory) and ort-cuda (the KV buffers are device memory bound by address).

A decode step's host work is constant (docs/runtime.md, "The decode step"): the past is bound at
its filled slots rounded up to PAST_BUCKET, the tail masked through key_mask, so its ~60 bindings
change once per bucket; the small inputs are arrays of the backend's own, bound once per shape
and overwritten in place; a one-token call's present.* land in staging buffers bound once per
cache and are copied to the write slot after the run (ort-cpu), instead of being rebound there."""
from __future__ import annotations

import ctypes

import numpy as np

from edgekv.errors import BackendUnavailable, BundleError, EdgeKVError
from edgekv.format.bundle import Bundle
from edgekv.runtime.backends.base import UNLIMITED, bound_past
from edgekv.runtime.cache import KVCache
from edgekv.runtime.memory import HostMemory, KVMemory
from edgekv.runtime.sequence import Sequence

PAST_BUCKET = 16  # slots: the past is bound at a multiple of this (1: exactly the filled slots; docs/runtime.md)


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


def cast_cache_reads(onnx_path) -> bytes:
    """The bundle's graph with every unit-scale DequantizeLinear of an int8 cache input replaced
    by the Cast it computes (x * 1.0 - 0: the same values, exactly). The graph is written with
    DQ because TensorRT's parser takes INT8 only through Q/DQ (docs/graph.md); onnxruntime's
    DequantizeLinear runs ~2x slower than its Cast, and at long contexts these reads of the
    whole past are most of a decode step's attention (docs/benchmarks.md)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path), load_external_data=False)
    g = model.graph
    inputs = {i.name: i.type.tensor_type.elem_type for i in g.input}
    consts = {t.name: t for t in g.initializer if t.data_location != onnx.TensorProto.EXTERNAL}

    def is_scalar(name: str, value: float) -> bool:  # a rank-0 constant equal to value
        t = consts.get(name)
        return t is not None and len(t.dims) == 0 and float(numpy_helper.to_array(t)) == value

    for node in g.node:
        if (node.op_type == "DequantizeLinear" and inputs.get(node.input[0]) == onnx.TensorProto.INT8
                and len(node.input) >= 2 and is_scalar(node.input[1], 1.0)
                and (len(node.input) < 3 or not node.input[2] or is_scalar(node.input[2], 0.0))
                and not any(a.name in ("block_size", "output_dtype") and a.i for a in node.attribute)):
            to = consts[node.input[1]].data_type  # DQ's output type is its scale's
            node.CopyFrom(onnx.helper.make_node("Cast", [node.input[0]], list(node.output), name=node.name, to=to))
    return model.SerializeToString()


class OrtBackend:
    """onnxruntime with IOBinding; the CPU provider (subclassed for CUDA)."""
    name = "ort-cpu"
    device = "cpu"
    max_tokens_per_call = UNLIMITED
    stage_present = True  # a one-token call writes present.* to staging buffers, copied to the cache after

    def __init__(self, bundle: Bundle, threads: int | None = None, max_logits_rows: int = 1,
                 past_bucket: int = PAST_BUCKET, matmul_accuracy: int = MATMUL_ACCURACY):
        ort = self.ort = _import_ort()
        self.check_available(ort)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or 0
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        # a memory plan per input shape: decode steps repeat a few shapes (the past is bound in
        # buckets), and one planned block per run is ~10 % faster than a node-by-node arena (docs/graph.md)
        opts.enable_mem_pattern = True
        # quantized weights: DequantizeLinear -> MatMul runs fused as MatMulNBits
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(matmul_accuracy))
        if not bundle.onnx_path.is_file():
            raise BundleError(f"{bundle.path}: corrupt bundle ({bundle.onnx_path.name} is missing)")
        # onnxruntime's QDQ propagation copies the int8 cache's unit Q/DQ across a Transpose with a
        # uint8 zero point, which opset 21 (INT4 weights) refuses at load (docs/weights.md)
        off = ["QDQPropagationTransformer"] if bundle.weights == "int4" else None
        try:
            graph = cast_cache_reads(bundle.onnx_path)
            # the rewritten graph comes as bytes: its weights are still found beside model.onnx
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                          str(bundle.onnx_path.parent))
            self.session = ort.InferenceSession(graph, opts, providers=self.providers(), disabled_optimizers=off)
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
        self.past_bucket = past_bucket
        self._small: dict[str, np.ndarray] = {}  # the small inputs' arrays, bound as they are
        self._bound: dict[str, tuple] = {}  # what the binding holds now, per part: small, past, present, logits
        self._stage: tuple = (None,)  # the last cache, its present.* staging arrays [1, 1, Hkv, D|-], their copies

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

    def _bind_logits(self, b: int, k: int) -> np.ndarray:
        logits = self._ensure_logits(b, k)
        key = (logits.ctypes.data, logits.shape)
        if self._bound.get("logits") != key:
            self._bound.pop("logits", None)
            self.io.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
            self._bound["logits"] = key
        return logits

    def _ensure_logits(self, b: int, k: int) -> np.ndarray:
        if self.logits.shape[0] < b or self.logits.shape[1] < k:
            self.logits = np.empty((max(b, self.logits.shape[0]), max(k, self.logits.shape[1]), self.vocab), np.float32)
        # a contiguous [b, k, V] block at the start of the buffer
        return self.logits.reshape(-1)[: b * k * self.vocab].reshape(b, k, self.vocab)

    def past_slots(self, cache: KVCache, seq: Sequence) -> int:
        """Slots bound as the past: the filled ones rounded up to the bucket (capped at the
        capacity), so the binding changes once per bucket; the sequence's key mask hides the rest."""
        return bound_past(seq.n, self.past_bucket, cache.capacity)

    def run(self, cache: KVCache, seq: Sequence, input_ids: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        if cache.memory.device != self.device:
            raise EdgeKVError(f"{self.name} needs its KV cache in {self.device} memory (build it with memory=backend.memory)")
        s = input_ids.shape[1]
        past = self.past_slots(cache, seq)
        return self._run(cache, past, seq.w, input_ids, seq.positions(s), seq.key_mask(s, past), logits_index)

    def _run(self, cache: KVCache, past: int, write: int, input_ids: np.ndarray, position_ids: np.ndarray,
             key_mask: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        """One graph call: past = slots [0, past), present to slots [write, write + S)."""
        b, s = input_ids.shape
        small = self._bind_small(s, logits_index.shape[1], past)
        np.copyto(small["input_ids"], input_ids)
        np.copyto(small["position_ids"], position_ids)
        np.copyto(small["logits_index"], logits_index)
        np.copyto(small["key_mask"], key_mask)
        self._bind_past(cache, past)
        staged = s == 1 and self.stage_present
        if staged:
            stage = self._bind_staged_present(cache)
        else:
            self._bind_present_at(cache, write, s)
        logits = self._bind_logits(b, logits_index.shape[1])
        self.session.run_with_iobinding(self.io)
        if staged:  # by address: the cache's memory may be any host memory (numpy, OrtValues)
            for base, row, src in stage:
                ctypes.memmove(base + write * row, src, row)
        return logits

    def run_cells(self, cache: KVCache, past: int, write: int, input_ids: np.ndarray, position_ids: np.ndarray,
                  key_mask: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        """One call over a pool of cells shared by several sequences (edgekv/runtime/engine.py):
        past = cells [0, past), present written at cells [write, write + S), positions and the
        per-token mask [1, S, past + S] given whole. Cells of the write run that lie inside the
        past are free, hence masked (as a ring's overwritten slots). The same constant-work
        binding as `run`: own small arrays, the past rebound only when `past` changes."""
        if cache.memory.device != self.device:
            raise EdgeKVError(f"{self.name} needs its KV cache in {self.device} memory (build it with memory=backend.memory)")
        return self._run(cache, past, write, input_ids, position_ids, key_mask, logits_index)

    # -- the binding, changed only where what it holds changed
    def _bind_small(self, s: int, k: int, past: int) -> dict[str, np.ndarray]:
        """The small inputs' own arrays for this call's shapes, bound once per shape."""
        if self._bound.get("small") != (s, k, past):
            self._bound.pop("small", None)  # an interrupt half-way must not leave a stale key
            self._small = {"input_ids": np.zeros((1, s), np.int64), "position_ids": np.zeros((1, s), np.int64),
                           "logits_index": np.zeros((1, k), np.int64), "key_mask": np.zeros((1, s, past + s), np.bool_)}
            for name, a in self._small.items():  # by address: the arrays are overwritten in place
                self.io.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
            self._bound["small"] = (s, k, past)
        return self._small

    def _bind_past(self, cache: KVCache, past: int) -> None:
        """past.* as the first `past` slots of every buffer (the cache is held in the key, so
        its identity cannot be taken by another one while bound)."""
        bound = self._bound.get("past")
        if bound and bound[0] is cache and bound[1] == past:
            return
        self._bound.pop("past", None)  # a Ctrl-C half-way through leaves some bound, some not: rebind all next time
        for name in cache.names:
            self.io.bind_input(name, self.device, 0, cache.dtypes[name], cache.slots_shape(name, past),
                               cache.ptr(name, 0))
        self._bound["past"] = (cache, past)

    def _bind_present_at(self, cache: KVCache, w: int, s: int) -> None:
        """present.* straight into the cache at the write slot: the graph writes it in place."""
        self._bound["present"] = None  # before: a half-done rebinding must not pass for the staged one
        for name in cache.names:
            self.io.bind_output("present" + name[4:], self.device, 0, cache.dtypes[name], cache.slots_shape(name, s),
                                cache.ptr(name, w))

    def _bind_staged_present(self, cache: KVCache) -> list[tuple[int, int, int]]:
        """present.* of a one-token call into staging arrays, bound once per cache; returns what
        the copy after the run needs: (buffer address, bytes per slot, staging address) each."""
        if self._stage[0] is not cache:
            arrays = {name: np.zeros(cache.slots_shape(name, 1), cache.dtypes[name]) for name in cache.names}
            copies = [(cache.ptr(name, 0), cache.row_bytes[name], a.ctypes.data) for name, a in arrays.items()]
            self._stage = (cache, arrays, copies)
        _, arrays, copies = self._stage
        bound = self._bound.get("present")
        if not (bound and bound[0] is cache):
            self._bound.pop("present", None)
            for name, st in arrays.items():
                self.io.bind_output("present" + name[4:], "cpu", 0, st.dtype, list(st.shape), st.ctypes.data)
            self._bound["present"] = (cache,)
        return copies


class OrtCudaBackend(OrtBackend):
    """onnxruntime's CUDA provider; the KV buffers are device memory bound by address."""
    name = "ort-cuda"
    device = "cuda"
    stage_present = False  # the cache is device memory: present.* is bound at the write slot

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
