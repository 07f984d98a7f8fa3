"""The `trt` backend: a TensorRT engine built on this device by `edgekv build-engine`.

Buffers are allocated once with cuda-python: the KV cache (CudaMemory, via KVCache), staging
buffers for the small inputs (sized for the largest call) and the logits; `close` frees them and
the stream. Per call the past is bound as the filled prefix and `present.*` at the write slot
(set_tensor_address), so the engine appends to the cache in place; the small inputs go up and
only the logits rows come back. TensorRT's inputs and outputs may not overlap, so a call whose
write slots lie inside the bound past (a shared pool writing into a freed run: `edgekv serve`,
chat's ring overwriting its oldest cells) writes `present.*` to staging buffers and copies them to the write
slots on the device after the run.

Written against the TensorRT 10 Python API (JetPack 6 ships 10.3). It cannot run on the
machines this project is developed on (no TensorRT there); `jetson/selftest.sh` checks it against
ort-cpu on the device."""
from __future__ import annotations

import numpy as np

from edgekv.errors import BackendUnavailable, EdgeKVError
from edgekv.format.bundle import LOCAL_MASK, Bundle
from edgekv.runtime.backends.engines import DECODE, PREFILL, find_engine
from edgekv.runtime.backends.gpu import CudaMemory, check
from edgekv.runtime.cache import KVCache


def import_tensorrt():
    try:
        import tensorrt as trt
    except ImportError:
        raise BackendUnavailable("the trt backend needs TensorRT's Python package (JetPack ships it as "
                                 "python3-libnvinfer; elsewhere pip install tensorrt from NVIDIA's index)") from None
    return trt


def gpu_name(cudart) -> str:
    props = check(cudart.cudaGetDeviceProperties(0))
    name = props.name
    return (name.decode(errors="replace") if isinstance(name, bytes) else str(name)).split("\x00")[0]


class TrtBackend:
    name = "trt"
    device = "cuda"
    past_bucket = 1  # the engine's addresses are set per call: binding the exact past costs nothing

    def __init__(self, bundle: Bundle, ctx: int, max_logits_rows: int = 1):
        self.trt = import_tensorrt()
        self.memory = CudaMemory()
        self.cudart = self.memory.cudart
        self.stream = None
        self._stage = (None, {})  # (the caches' slot layout, name -> staging buffer of max_tokens_per_call slots)
        try:
            self._start(bundle, ctx, max_logits_rows)
        except BaseException:  # free what was allocated before the failure
            self.close()
            raise

    def _start(self, bundle: Bundle, ctx: int, max_logits_rows: int) -> None:
        trt, cudart = self.trt, self.cudart
        gpu = gpu_name(cudart)
        found = find_engine(bundle, gpu, trt.__version__, ctx)
        if found is None:
            raise BackendUnavailable(f"no TensorRT engine of {bundle.path.name} for {gpu}, TensorRT {trt.__version__}, "
                                     f"a {ctx}-slot cache: build one with `edgekv build-engine {bundle.path} --ctx {ctx}`")
        folder, info = found
        self.engine_info = info
        self.max_tokens_per_call = int(info["max_prefill"])
        logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(logger)
        self.engine = self.runtime.deserialize_cuda_engine((folder / "model.plan").read_bytes())
        if self.engine is None:
            raise EdgeKVError(f"{folder}: TensorRT could not load the engine (rebuild it with `edgekv build-engine --force`)")
        self.stream = check(cudart.cudaStreamCreate())
        self.stream_handle = int(self.stream)  # TensorRT takes the raw handle
        # one execution context per profile: decode steps and prefill chunks never re-select a profile
        self.contexts = []
        for p in (DECODE, PREFILL):
            c = self.engine.create_execution_context()
            c.set_optimization_profile_async(p, self.stream_handle)
            self.contexts.append(c)
        check(cudart.cudaStreamSynchronize(self.stream))
        self.vocab = bundle.model["vocab_size"]
        rows = max(max_logits_rows, self.max_tokens_per_call)
        # staging for the small inputs and the logits, sized once for the largest call
        self.d_ids = self.memory.alloc((1, self.max_tokens_per_call), np.int64)
        self.d_pos = self.memory.alloc((1, self.max_tokens_per_call), np.int64)
        self.d_idx = self.memory.alloc((1, rows), np.int64)
        self.d_mask = self.memory.alloc((1, self.max_tokens_per_call, int(info["ctx"]) + self.max_tokens_per_call), np.bool_)
        # a model with sliding-window layers: their mask, the same shape (None: the graph has no such input)
        self.d_local = (self.memory.alloc(self.d_mask.shape, np.bool_)
                        if LOCAL_MASK in bundle.manifest["io"]["inputs"] else None)
        self.d_logits = self.memory.alloc((1, rows, self.vocab), np.float32)
        self.logits = np.empty((1, rows, self.vocab), np.float32)

    def _up(self, buf, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, buf.dtype)
        check(self.cudart.cudaMemcpyAsync(buf.ptr, arr.ctypes.data, arr.nbytes,
                                      self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def run_cells(self, cache: KVCache, past: int, write: int, input_ids: np.ndarray, position_ids: np.ndarray,
                  key_mask: np.ndarray, logits_index: np.ndarray,
                  local_key_mask: np.ndarray | None = None, ring: tuple | None = None) -> np.ndarray:
        """past = slots [0, past), present to slots [write, write + S), the masks [1, S, past + S] given
        (`ring`: never, this backend does not window a cache)."""
        if cache.memory.device != "cuda":
            raise EdgeKVError("trt needs its KV cache in device memory (build it with memory=backend.memory)")
        b, s = input_ids.shape
        k = logits_index.shape[1]
        if b != 1 or s > self.max_tokens_per_call or k > s:
            raise EdgeKVError(f"trt: this engine takes batch 1 and at most {self.max_tokens_per_call} tokens per call "
                              f"(got batch {b}, {s} tokens)", setting="max_prefill", fix="rebuild the engine with a larger {}")
        ctx = self.contexts[DECODE if s == 1 else PREFILL]
        self._up(self.d_ids, input_ids)
        self._up(self.d_pos, position_ids)
        self._up(self.d_idx, logits_index)
        self._up(self.d_mask, key_mask)
        small = [("input_ids", self.d_ids, (1, s)), ("position_ids", self.d_pos, (1, s)),
                 ("logits_index", self.d_idx, (1, k)), ("key_mask", self.d_mask, key_mask.shape)]
        if self.d_local is not None:
            if local_key_mask is None:
                raise EdgeKVError(f"trt: this engine has sliding-window layers and needs their {LOCAL_MASK}")
            self._up(self.d_local, local_key_mask)
            small.append((LOCAL_MASK, self.d_local, local_key_mask.shape))
        for name, buf, shape in small:
            ctx.set_input_shape(name, tuple(shape))
            ctx.set_tensor_address(name, buf.ptr)
        stage = self._staging(cache) if write < past else None  # the write slots lie inside the past
        for name in cache.names:
            ctx.set_input_shape(name, tuple(cache.slots_shape(name, past)))
            ctx.set_tensor_address(name, cache.ptr(name, 0))  # past: slots [0, past)
            ctx.set_tensor_address("present" + name[4:], stage[name].ptr if stage else cache.ptr(name, write))
        ctx.set_tensor_address("logits", self.d_logits.ptr)
        if not ctx.execute_async_v3(self.stream_handle):
            raise EdgeKVError("trt: the engine failed to run (see TensorRT's message above)")
        if stage:
            for name in cache.names:  # on the device, in stream order, before anything reads the cache
                check(self.cudart.cudaMemcpyAsync(cache.ptr(name, write), stage[name].ptr, s * cache.row_bytes[name],
                                              self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream))
        out = self.logits.reshape(-1)[: k * self.vocab].reshape(1, k, self.vocab)
        check(self.cudart.cudaMemcpyAsync(out.ctypes.data, self.d_logits.ptr, out.nbytes,
                                      self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))
        check(self.cudart.cudaStreamSynchronize(self.stream))
        return out

    def _staging(self, cache: KVCache) -> dict:
        """present.* staging: max_tokens_per_call slots per buffer, allocated at first use and
        shared by every cache of the same layout (the bundle's: one set per backend)."""
        layout = tuple((name, tuple(cache.slots_shape(name, 1)), str(cache.dtypes[name])) for name in cache.names)
        if self._stage[0] != layout:
            self._stage = (layout, {name: self.memory.alloc(cache.slots_shape(name, self.max_tokens_per_call),
                                                            cache.dtypes[name]) for name in cache.names})
        return self._stage[1]

    def close(self) -> None:
        """Free the device buffers (the KV caches allocated from this backend's memory too) and the stream."""
        if self.stream is not None:
            self.cudart.cudaStreamSynchronize(self.stream)
            self.cudart.cudaStreamDestroy(self.stream)
            self.stream = None
        self.memory.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
