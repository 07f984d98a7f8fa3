"""Stand-ins for cuda-python's runtime and TensorRT, so the trt backend and the engine build run
their own logic here (no GPU, no TensorRT).

Device memory is host memory (a "device pointer" is a host address); the fake engine runs the
bundle's ONNX graph with onnxruntime on whatever addresses and shapes the backend set, after
checking every input shape against the optimization profile the backend selected. So a wrong
address, slot offset, shape, staging copy, profile choice or logits copy-back in our code gives
wrong logits or an error, exactly as on a GPU. What it cannot check is TensorRT itself (the
parser, kernels, API spelling): jetson/selftest.sh does that on the device."""
from __future__ import annotations

import ctypes
import json
import types

import numpy as np


# -- cuda-python's runtime ----------------------------------------------------------------------

class _Err(int):
    name = "cudaSuccess"


OK = _Err(0)


class FakeCudart(types.ModuleType):
    def __init__(self):
        super().__init__("cuda.bindings.runtime")
        self.allocs: dict[int, np.ndarray] = {}
        self.streams: set[int] = set()
        self.cudaMemcpyKind = types.SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2,
                                                    cudaMemcpyDeviceToDevice=3)

    def cudaMalloc(self, n):
        a = np.empty(n, np.uint8)
        self.allocs[a.ctypes.data] = a
        return OK, a.ctypes.data

    def cudaFree(self, ptr):
        self.allocs.pop(ptr, None)
        return (OK,)

    def cudaMemset(self, ptr, value, n):
        ctypes.memset(ptr, value, n)
        return (OK,)

    def cudaMemcpy(self, dst, src, n, kind):
        ctypes.memmove(dst, src, n)
        return (OK,)

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        ctypes.memmove(dst, src, n)
        return (OK,)

    def cudaMemcpy2D(self, dst, dpitch, src, spitch, width, height, kind):
        assert width <= min(dpitch, spitch), "cudaMemcpy2D: a row wider than its pitch"
        self.copies2d = getattr(self, "copies2d", 0) + 1
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        return (OK,)

    def cudaDeviceSynchronize(self):
        return (OK,)

    def cudaStreamCreate(self):
        handle = 7 + len(self.streams)
        self.streams.add(handle)
        return OK, handle

    def cudaStreamDestroy(self, stream):
        self.streams.remove(stream)
        return (OK,)

    def cudaStreamSynchronize(self, stream):
        return (OK,)

    def cudaMemGetInfo(self):
        return OK, 8 << 30, 16 << 30

    def cudaGetDeviceProperties(self, device):
        return OK, types.SimpleNamespace(name=b"Fake Orin\x00\x00")


# -- TensorRT --------------------------------------------------------------------------------------

def _np_type(ort_type: str):
    return {"tensor(int64)": np.int64, "tensor(bool)": np.bool_, "tensor(int8)": np.int8,
            "tensor(uint8)": np.uint8, "tensor(float16)": np.float16, "tensor(float)": np.float32}[ort_type]


class FakeContext:
    def __init__(self, engine):
        self.engine, self.profile, self.shapes, self.addrs = engine, None, {}, {}

    def set_optimization_profile_async(self, index, stream):
        assert isinstance(stream, int), "TensorRT takes the raw stream handle"
        self.profile = index
        return True

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        self.addrs[name] = int(ptr)
        return True

    def execute_async_v3(self, stream):
        import onnxruntime as ort

        prof = self.engine.profiles[self.profile]
        sess = self.engine.session
        io = sess.io_binding()
        for i in sess.get_inputs():
            shape = self.shapes[i.name]
            lo, _, hi = prof[i.name]
            assert all(a <= s <= b for a, s, b in zip(lo, shape, hi)), f"{i.name} {shape} outside profile {self.profile}"
            io.bind_input(i.name, "cpu", 0, _np_type(i.type), list(shape), self.addrs[i.name])
        s = self.shapes["input_ids"][1]
        k = self.shapes["logits_index"][1]
        out_shapes = {}
        for o in sess.get_outputs():
            if o.name == "logits":
                shape = [1, k, self.engine.vocab]
            else:
                shape = [s] + list(self.shapes["past" + o.name[7:]][1:])
            out_shapes[o.name] = shape
            io.bind_output(o.name, "cpu", 0, _np_type(o.type), shape, self.addrs[o.name])
        spans = {n: (self.addrs[n], self.addrs[n] + int(np.prod(shape)) * np.dtype(_np_type(t)).itemsize)
                 for n, shape, t in [(i.name, self.shapes[i.name], i.type) for i in sess.get_inputs()]
                 + [(o.name, out_shapes[o.name], o.type) for o in sess.get_outputs()]}
        for o in sess.get_outputs():  # TensorRT: an output may not overlap any input
            lo, hi = spans[o.name]
            assert not [i.name for i in sess.get_inputs() if spans[i.name][0] < hi and lo < spans[i.name][1]], \
                f"output {o.name} overlaps an input"
        sess.run_with_iobinding(io)
        del ort
        return True


GRAPHS: dict[str, bytes] = {}  # the graphs "built into" engines, with their weights (the parsed file may be gone)


class FakeEngine:
    def __init__(self, plan: dict):
        import onnxruntime as ort

        self.profiles = [{n: tuple(tuple(x) for x in v) for n, v in p.items()} for p in plan["profiles"]]
        opts = ort.SessionOptions()
        opts.enable_mem_pattern = False
        self.session = ort.InferenceSession(GRAPHS[plan["onnx"]], opts, providers=["CPUExecutionProvider"])
        self.vocab = plan["vocab"]

    def create_execution_context(self):
        return FakeContext(self)


class FakeTensorRT(types.ModuleType):
    __version__ = "10.3.0"

    def __init__(self):
        super().__init__("tensorrt")
        self.built = 0
        trt = self

        class Logger:
            WARNING = 2

            def __init__(self, level=None):
                pass

        class Runtime:
            def __init__(self, logger):
                pass

            def deserialize_cuda_engine(self, data):
                return FakeEngine(json.loads(bytes(data)))

        class Profile:
            def __init__(self):
                self.shapes = {}

            def set_shape(self, name, lo, opt, hi):
                self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))

        class Config:
            def __init__(self):
                self.profiles = []

            def set_memory_pool_limit(self, pool, size):
                pass

            def add_optimization_profile(self, p):
                self.profiles.append(p)

        class Network:
            onnx = None

        class OnnxParser:
            num_errors = 0

            def __init__(self, network, logger):
                self.network = network

            def parse_from_file(self, path):
                """Refuses what check-trt refuses, as the real parser would (the rules' own tests
                hold check-trt to the parser's documents)."""
                from edgekv.format.trt_rules import check_model

                self.errors = [str(v) for v in check_model(path, trt.__version__[:4])]
                self.num_errors = len(self.errors)
                self.network.onnx = path
                return not self.errors

            def get_error(self, i):
                return self.errors[i]

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                assert flags == 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
                return Network()

            def create_builder_config(self):
                return Config()

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                import onnx

                trt.built += 1
                m = onnx.load(network.onnx)  # an engine holds its weights
                key = f"graph{len(GRAPHS)}"
                GRAPHS[key] = m.SerializeToString()
                vocab = next(o for o in m.graph.output if o.name == "logits").type.tensor_type.shape.dim[2].dim_value
                return json.dumps({"onnx": key, "vocab": vocab,
                                   "profiles": [p.shapes for p in config.profiles]}).encode()

        self.Logger, self.Runtime, self.Builder, self.OnnxParser = Logger, Runtime, Builder, OnnxParser
        self.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=5)
        self.MemoryPoolType = types.SimpleNamespace(WORKSPACE=0)


def install(monkeypatch) -> tuple[FakeTensorRT, FakeCudart]:
    """Put the fakes where `import tensorrt` and cuda-python's runtime import look."""
    import sys

    trt, rt = FakeTensorRT(), FakeCudart()
    cuda = types.ModuleType("cuda")
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = rt
    cuda.bindings = bindings
    for name, mod in (("tensorrt", trt), ("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.runtime", rt)):
        monkeypatch.setitem(sys.modules, name, mod)
    return trt, rt


# -- ort-cuda's own code on the CPU provider -----------------------------------------------------

def cuda_on_cpu():
    """OrtCudaBackend's own choices and code (its fused graph, its OrtValue memories, its calls),
    its device a parameter: the CPU provider, host OrtValues (tests/test_fused_cuda.py,
    tests/test_backends.py)."""
    from edgekv.runtime.backends.ort_cuda import OrtCudaBackend

    class CudaOnCpu(OrtCudaBackend):
        device = "cpu"

        def check_available(self, ort):
            pass

        def providers(self):
            return ["CPUExecutionProvider"]

        def check_session(self):
            pass

    return CudaOnCpu

