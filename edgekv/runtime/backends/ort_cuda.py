"""ort-cuda: onnxruntime's CUDA provider (the KV buffers are device memory bound by address),
with the fused graph where CUDA's GroupQueryAttention allows it (docs/fused.md, "ort-cuda")."""
from __future__ import annotations

import numpy as np

from edgekv.errors import BackendUnavailable, EdgeKVError
from edgekv.format.bundle import Bundle
from edgekv.graph.index import prune_unneeded
from edgekv.graph.passes import Changed
from edgekv.graph.passes.fused_match import SEQLENS, TOTAL
from edgekv.runtime.backends.fused import ATTENTION_ENV, FUSED_SPARE, FusedCalls
from edgekv.runtime.backends.ort import OrtBackend
from edgekv.runtime.cache import KVCache
from edgekv.runtime.memory import KVMemory


# onnxruntime's CUDA GroupQueryAttention before the release whose schema documents otherwise
# (the installed 1.32's: "CUDA rejects attention_bias when sliding_window_cache is 1" and
# query_seqlens "honored by the CPU and CUDA execution providers") returns "attention_bias is not
# supported in GroupQueryAttention cuda kernel" for any bias (contrib_ops/cuda/bert/
# group_query_attention.cc as read in older sources). Which one a machine has is probed at load
# (cuda_takes_bias); without the bias the op's own rule, each entry causal over its first
# seqlens_k + 1 slots, is the only mask (docs/fused.md, "ort-cuda")
CUDA_NO_BIAS = "this onnxruntime's CUDA GroupQueryAttention takes no attention_bias"


def cuda_takes_bias(ort, providers: list) -> tuple[bool, str]:
    """Whether GroupQueryAttention on `providers` runs with an attention_bias: one float16 node,
    one decode step over a past of one (what the fused graph's calls are), run; (ok, why not)."""
    from onnx import TensorProto as T, helper

    D = 64
    vi = helper.make_tensor_value_info
    node = helper.make_node("GroupQueryAttention", ["q", "", "", "pk", "pv", "sk", "tl", "", "", "", "bias"],
                            ["o", "k", "v"], domain="com.microsoft", num_heads=1, kv_num_heads=1)
    graph = helper.make_graph([node], "probe",
                              [vi("q", T.FLOAT16, [1, 1, 3 * D]), vi("pk", T.FLOAT16, [1, 1, 1, D]),
                               vi("pv", T.FLOAT16, [1, 1, 1, D]), vi("sk", T.INT32, [1]), vi("tl", T.INT32, []),
                               vi("bias", T.FLOAT16, [1, 1, 1, 2])],
                              [vi("o", T.FLOAT16, None), vi("k", T.FLOAT16, None), vi("v", T.FLOAT16, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8)  # onnxruntime-gpu 1.2x reads IR 8 (onnx's default is newer)
    feeds = {"q": np.ones((1, 1, 3 * D), np.float16), "pk": np.zeros((1, 1, 1, D), np.float16),
             "pv": np.zeros((1, 1, 1, D), np.float16), "sk": np.array([1], np.int32), "tl": np.array(2, np.int32),
             "bias": np.zeros((1, 1, 1, 2), np.float16)}
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), opts, providers=providers).run(None, feeds)
    except Exception as e:  # the kernel's refusal, or anything else: the bias is not usable here
        return False, str(e).splitlines()[0][:200]
    return True, ""


def without_bias(model) -> None:
    """The fused model (in place) with every GroupQueryAttention's attention_bias input left
    empty, and the bias inputs and their casts pruned (CUDA_NO_BIAS)."""
    for n in model.graph.node:
        if n.op_type == "GroupQueryAttention" and len(n.input) > 10:
            n.input[10] = ""
    need = prune_unneeded(model.graph)
    inputs = [i for i in model.graph.input if i.name in need or i.name.startswith("past.")]
    del model.graph.input[:]
    model.graph.input.extend(inputs)


class WithoutBias:
    """without-bias: the fused graph's GroupQueryAttentions without attention_bias (CUDA_NO_BIAS)."""
    name = "without-bias"

    def apply(self, index) -> Changed:
        without_bias(index.model)
        return Changed(True)


def op_rule_call(past: int, write: int, position_ids: np.ndarray, key_mask: np.ndarray | None) -> bool:
    """A call the op's own rule describes: its tokens appended at the end of the past (write ==
    past), at positions past + i (so whether CUDA's kernel rotates by position_ids or by the
    cache's length, the two agree), every past slot seen and the new block causal."""
    s = position_ids.shape[1]
    if write != past or not np.array_equal(position_ids[0], np.arange(past, past + s)):
        return False
    return bool(key_mask[0, :, :past].all()) and np.array_equal(key_mask[0, :, past:], np.tri(s, dtype=np.bool_))


class CudaFusedCalls(FusedCalls):
    """The fused graph's calls in device memory; without attention_bias only a stream's appends."""

    def move_slots(self, cache: KVCache, src: int, dst: int, n: int) -> None:
        for buf in cache.buffers.values():  # on the device: nothing crosses to the host
            cache.memory.copy_slots(buf, src, dst, n)

    def call(self, cache: KVCache, past: int, write: int, input_ids: np.ndarray, position_ids: np.ndarray,
             key_mask: np.ndarray, logits_index: np.ndarray,
             local_key_mask: np.ndarray | None = None) -> np.ndarray:
        """FusedCalls' call; without attention_bias only where the op's own rule is the
        call's mask (op_rule_call), the new tokens written at `past` by the op itself, and any
        other call (a pool's masked or moved cells) one line, never a wrong attention."""
        be = self.be
        if not be.single_stream:
            return super().call(cache, past, write, input_ids, position_ids, key_mask, logits_index, local_key_mask)
        s = input_ids.shape[1]
        if not op_rule_call(past, write, position_ids, key_mask):
            raise EdgeKVError(f"{be.name} (fused attention) runs only a sequence appending at its end ({CUDA_NO_BIAS}); "
                              f"this call writes {s} tokens at cell {write} after a past of {past} under a mask: "
                              f"{ATTENTION_ENV}=plain runs it")
        be.binding.feeds({"input_ids": np.ascontiguousarray(input_ids, np.int64),
                          "position_ids": np.ascontiguousarray(position_ids, np.int64),
                          "logits_index": np.ascontiguousarray(logits_index, np.int64),
                          SEQLENS: np.array([past + s - 1], np.int32), TOTAL: np.array(past + s, np.int32)})
        be.binding.whole_cache(cache)
        logits = be.binding.logits_for(1, logits_index.shape[1])
        be.binding.run(be.session)
        return logits

    def slot_memory(self, slots: int) -> KVMemory:
        if self.be.single_stream:
            raise BackendUnavailable(f"ort-cuda runs no fused slots here ({CUDA_NO_BIAS}: an older kernel, "
                                     f"which reads no query_seqlens either)")
        super().slot_memory(slots)  # the CPU's conditions: the fused graph, query_seqlens
        from edgekv.runtime.backends.gpu import OrtValueSlotMemory
        return OrtValueSlotMemory(self.be.ort, self.be.device, slots)


class OrtCudaBackend(OrtBackend):
    """onnxruntime's CUDA provider; the KV buffers are device memory bound by address. The
    device (`device`) is a parameter of its memories, so tests run this class's code on the CPU
    provider with host OrtValues (tests/test_fused_cuda.py)."""
    name = "ort-cuda"
    device = "cuda"
    stage_present = False  # the cache is device memory: present.* is bound at the write slot
    exact_attention = False  # the graph as written: its u8 x s8 MatMul would run on the CPU
    # the fused graph of a float16/bfloat16 bundle (CUDA's GroupQueryAttention has no float32
    # kernel); where the kernel takes no attention_bias (probed), only single streams, and only
    # when asked: fused_refusal, adapt_fused
    fuses = True
    runs_slots = True  # serve's fused slots, in device memory (gpu.OrtValueSlotMemory); not without the bias
    fold_minimums = False  # the graph as written (CUDA's MatMulNBits with zero points is not tested)
    single_stream = False  # the fused graph without attention_bias: calls the op's own rule masks (op_rule_call)
    fused_calls = CudaFusedCalls

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
        return OrtValueMemory(self.ort, self.device)

    def fused_memory(self) -> KVMemory:
        from edgekv.runtime.backends.gpu import OrtValueHeadMajorMemory
        # spare slots for the moved calls, which need the bias (without it none runs)
        return OrtValueHeadMajorMemory(self.ort, self.device, 0 if self.single_stream else FUSED_SPARE)

    def takes_bias(self) -> tuple[bool, str]:
        """cuda_takes_bias on this backend's providers, probed once."""
        if "_bias" not in self.__dict__:
            self._bias = cuda_takes_bias(self.ort, self.providers())
        return self._bias

    def fused_refusal(self, bundle: Bundle, mode: str) -> str | None:
        if bundle.dtype == "float32":
            return ("CUDA's GroupQueryAttention runs float16 and bfloat16 graphs, this bundle is float32 "
                    "(export --dtype float16 for the fused graph on ort-cuda)")
        bias, why = self.takes_bias()
        if bias:
            return None  # the CPU's fused path, on the device
        if bundle.window is not None:
            return f"its sliding-window layers need attention_bias, and {CUDA_NO_BIAS} ({why})"
        if mode == "auto":  # chat and serve's cell pool need masks: the graph as written serves every caller
            return (f"{CUDA_NO_BIAS} ({why}), so the fused graph would run single streams only (generate, eval, "
                    f"bench), not chat's or serve's masked calls; {ATTENTION_ENV}=fused runs it")
        return None

    def adapt_fused(self, fused) -> list:
        if self.takes_bias()[0]:
            return []
        self.single_stream = True
        self.runs_slots = False  # an idle slot's cells need query_seqlens, which that older kernel does not read
        self.fused_inputs = (SEQLENS, TOTAL)
        self.attention += f"; without attention_bias: single streams only ({CUDA_NO_BIAS})"
        return [WithoutBias()]
