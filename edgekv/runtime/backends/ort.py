"""The onnxruntime backends (edgekv/runtime/backends/base.py has the protocol they follow):
ort-cpu (host memory); ort-cuda, its subclass for device memory, is ort_cuda.py.

A backend is a list of graph passes plus a session (docs/graph.md, "Graph passes"): at load the
bundle's graph goes through the passes (`graph_passes`: the fused rewrite or the plain graph's
cache reads and exact sums, then the weight passes), onnxruntime's session runs what comes out, and
the load line names the passes that changed it. Its calls are one class per graph: plain.py's
(the graph as written) or fused.py's (the fused graph).

A decode step's host work is constant (docs/runtime.md, "The decode step"): the past is bound at
its filled slots rounded up to PAST_BUCKET, the tail masked through key_mask, so its ~60 bindings
change once per bucket; the small inputs are arrays of the backend's own, bound once per shape
and overwritten in place; a one-token call's present.* land in staging buffers bound once per
cache and are copied to the write slot after the run (ort-cpu), instead of being rebound there."""
from __future__ import annotations

import os

import numpy as np

from edgekv.errors import BackendUnavailable, BundleError, EdgeKVError, note
from edgekv.format.bundle import LOCAL_MASK, Bundle
from edgekv.graph import passes
from edgekv.graph.forms import Handed
from edgekv.graph.index import GraphIndex
from edgekv.graph.passes.cache_reads import CacheReads
from edgekv.graph.passes.exact_sums import ExactSums
from edgekv.graph.passes.minimum_fold import MinimumFold
from edgekv.graph.passes.weight_forms import WeightForms
from edgekv.runtime.backends.base import UNLIMITED, default_threads
from edgekv.runtime.backends.binding import Binding
from edgekv.graph.passes.fused_match import BIAS_LOCAL
from edgekv.runtime.backends.fused import (FUSED_INPUTS, FUSED_SPARE, QUERY_LENGTHS_ORT, FusedCalls, QueryLengths,
                                           choose_attention, ort_at_least)
from edgekv.runtime.backends.nbits8 import Nbits8
from edgekv.runtime.backends.plain import PlainCalls
from edgekv.runtime.backends.rows import RowPadding, RowPlan
from edgekv.runtime.backends.versions import too_old
from edgekv.runtime.cache import KVCache
from edgekv.runtime.memory import HeadMajorMemory, HostMemory, KVMemory, SlotMemory, give_memory_back

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

# Row-independent attention (edgekv/graph/passes/exact_sums.py) runs by default;
# EDGEKV_EXACT=0 runs the graph as written (faster prefill, batch-dependent greedy text).
EXACT_ENV = "EDGEKV_EXACT"


def exact_default() -> bool:
    return os.environ.get(EXACT_ENV, "1").strip() not in ("0", "false", "no", "off")


def cast_cache_reads(onnx_path) -> bytes:
    """The bundle's graph with the cache-reads pass applied (edgekv/graph/passes/cache_reads.py)."""
    index = GraphIndex.from_path(onnx_path)
    CacheReads().apply(index)
    return index.serialize()


def session_options(ort, threads: int | None, matmul_accuracy: int):
    """The CPU session's options, for the graph as written and for derived (fused) graphs alike
    (the fused session then turns the memory pattern off: OrtBackend.__init__)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or default_threads()
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    # a memory plan per input shape: the graph as written repeats a few shapes (the past is bound
    # in buckets), and one planned block per run is ~10 % faster than a node-by-node arena (docs/graph.md)
    opts.enable_mem_pattern = True
    # quantized weights: DequantizeLinear -> MatMul runs fused as MatMulNBits
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(matmul_accuracy))
    return opts


def link_refusal(e: Exception) -> str | None:
    """"hard link" or "symbolic link" where `e` is onnx's refusal to read a tensor's external data
    from such a file (onnx.checker.ValidationError), else None."""
    text = str(e)
    if "should be stored in" not in text:
        return None
    return "hard link" if "multiple hard links" in text else "symbolic link" if "symbolic link" in text else None


def load_refusal(bundle: Bundle, e: Exception) -> BundleError:
    """The one line for a graph that onnx or onnxruntime would not load. onnx (>= 1.19) refuses to
    read weights from a file with other hard links or through a symbolic link: the bundle is
    intact, so the line says how to copy it (format.bundle.allow_hardlinked_weights lifts the
    first where this onnx lets it); anything else is a corrupt bundle."""
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    msg, link = first[:200], link_refusal(e)
    if link == "hard link":
        return BundleError(f"{bundle.path}: its weights file has other hard links (a copy made with cp -al or "
                           f"rsync --link-dest), which the installed onnx refuses to read; copy the bundle without "
                           f"links: cp -r {bundle.path} NEW_FOLDER")
    if link == "symbolic link":
        return BundleError(f"{bundle.path}: its weights file is a symbolic link, which onnx refuses to read "
                           f"through; put the file itself in the bundle: cp -rL {bundle.path} NEW_FOLDER")
    return BundleError(f"{bundle.path}: corrupt bundle (onnxruntime cannot load {bundle.onnx_path.name}: {msg})")


class OrtBackend:
    """onnxruntime with IOBinding; the CPU provider (subclassed for CUDA)."""
    name = "ort-cpu"
    device = "cpu"
    max_tokens_per_call = UNLIMITED
    stage_present = True  # a one-token call writes present.* to staging buffers, copied to the cache after
    exact_attention = True  # ExactAttention's integer products are CPU kernels (MatMulInteger u8 x s8)
    fuses = True  # the fused graph (GroupQueryAttention's int8-cache CPU kernel) runs here
    # a GGUF minimum term's integer part becomes MatMulNBits' zero points (minimum_fold.py: on its rounded activations)
    fold_minimums = True
    fused_inputs = FUSED_INPUTS  # what the fused graph reads beside the bundle's own inputs
    runs_slots = True  # serve's fused slots (run_slots: query_seqlens, which the CPU kernel reads)
    fused_calls = FusedCalls  # the fused graph's calls on this provider
    profile_prefix: str | None = None  # onnxruntime's profiler on, its JSON named so (jetson/selftest.py)

    def __init__(self, bundle: Bundle, threads: int | None = None, max_logits_rows: int = 1,
                 past_bucket: int = PAST_BUCKET, matmul_accuracy: int = MATMUL_ACCURACY,
                 exact: bool | None = None, attention: str | None = None):
        ort = self.ort = _import_ort()
        if (old := too_old(ort.__version__)) is not None:  # below 1.21 (an onnxruntime-gpu pip did not check)
            raise BackendUnavailable(old)
        self.check_available(ort)
        opts = session_options(ort, threads, matmul_accuracy)
        if self.profile_prefix:  # onnxruntime's per-node profile (which provider ran each node: jetson/selftest.py)
            opts.enable_profiling, opts.profile_file_prefix = True, self.profile_prefix
        if not bundle.onnx_path.is_file():
            raise BundleError(f"{bundle.path}: corrupt bundle ({bundle.onnx_path.name} is missing)")
        # onnxruntime's QDQ propagation copies the int8 cache's unit Q/DQ across a Transpose with a
        # uint8 zero point, which opset 21 (INT4 weights) refuses at load (docs/weights.md)
        off = ["QDQPropagationTransformer"] if bundle.weights == "int4" else None
        # the graph this session runs: the fused one where it can (self.fused), else as written;
        # self.attention says which and why (the load log)
        try:
            self.fused, self.attention = choose_attention(self, bundle, attention)
        except Exception as e:  # the fused graph's rewrite reads weights through onnx too
            if link_refusal(e):
                raise load_refusal(bundle, e) from None
            raise
        if self.fused is not None:
            # a fused call's shapes follow the fill, so onnxruntime's plan per shape (the memory
            # pattern) is made once per step and kept: +18 MiB over 1,000 decoded tokens, never
            # reused; without it the RSS holds flat and decode is no slower (docs/graph.md)
            opts.enable_mem_pattern = False
        try:
            index = self._graph_passes(bundle, opts, matmul_accuracy, exact)
            # the arrays the passes derived, by reference, as long as the session lives
            self._handed = Handed([(n, a) for n, a in index.handed.items() if n in index.inits]).hand_to(ort, opts)
            # the rewritten graph comes as bytes: its weights are still found beside model.onnx
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                          str(bundle.onnx_path.parent))
            graph = index.serialize()
            del index
            if self.fused is not None:
                self.fused.keep_only_bytes(graph)
            # the passes' freed objects (~60 MiB for the default model) go back before the session's own peak
            give_memory_back()
            self.session = ort.InferenceSession(graph, opts, providers=self.providers(), disabled_optimizers=off)
            del graph
            give_memory_back()  # and onnxruntime's own, from optimizing and prepacking
        except Exception as e:  # onnxruntime raises its own exception types for a bad file
            raise load_refusal(bundle, e) from None
        self.check_session()
        if self.fused is not None:  # a path new to the user: the load log says it runs, how to leave it, its passes
            note(f"{self.attention}; {self.load_line}")
        if (line := self.rows.line()) is not None:
            note(line)
        self.vocab = bundle.model["vocab_size"]
        self.window = bundle.window  # the sliding-window layers' (None without them)
        self.binding = Binding(self.session, self.device, self.vocab, max_logits_rows)
        graph_inputs = {i.name for i in self.session.get_inputs()}
        self.local_mask = LOCAL_MASK in graph_inputs  # a model with sliding-window layers: their mask is fed too
        self.local_bias = BIAS_LOCAL in graph_inputs  # ... and, fused, their bias (docs/fused.md, "Architectures")
        # one class per graph: its calls, its cache's memory and layout, its bucket and call size
        self.calls = self.fused_calls(self) if self.fused is not None else PlainCalls(self, past_bucket)
        if graph_inputs != self.calls.expected_inputs(bundle):
            raise BundleError(f"{bundle.path}: corrupt bundle (graph inputs do not match the manifest)")
        self.memory = self.calls.memory()
        self.past_bucket = self.calls.past_bucket
        self.max_tokens_per_call = self.calls.max_tokens_per_call

    def _graph_passes(self, bundle: Bundle, opts, matmul_accuracy: int, exact: bool | None) -> GraphIndex:
        """The graph the session runs: the passes for this provider and graph, applied (self.ran)."""
        folder = str(bundle.onnx_path.parent)
        if self.fused is not None:
            self.exact = False  # GroupQueryAttention sums as it does
            index = GraphIndex(self.fused.model, folder)
            self.ran = [passes.Ran(self.fused.rewrite.name, self.fused.rewrite)]
            graph = self.adapt_fused(self.fused)
            # serve's slots need query_seqlens (onnxruntime >= 1.32); without it the fused graph
            # still runs one stream, and run_slots says why it cannot run
            self.query_lengths = self.runs_slots and ort_at_least(self.ort.__version__, QUERY_LENGTHS_ORT)
            graph += [QueryLengths()] if self.query_lengths else []
        else:
            index, self.ran, self.query_lengths = GraphIndex.from_path(bundle.onnx_path), [], False
            # row-independent attention (default: EDGEKV_EXACT, on); self.exact: whether it runs
            want = self.exact_attention and (exact_default() if exact is None else exact)
            graph = [CacheReads()] + ([ExactSums(bundle.max_context)] if want else [])
        # what the weights need: the GGUF minimum folded (None: not tried), packed codes unpacked
        # (ours, not folded by onnxruntime), 8-bit block weights as MatMulNBits where onnxruntime
        # < 1.25 does not fuse them (nbits8.py; its line: the load log's where its kernel does not
        # run them either), and weight products whose rows do not depend on the call's row count
        # on this CPU (rows.py)
        fold = MinimumFold() if self.fold_minimums else None
        weights = [fold] if fold else []
        weights += [WeightForms(), Nbits8(self.ort, matmul_accuracy, self.device)]
        rows = RowPadding(opts.intra_op_num_threads, matmul_accuracy) if self.device == "cpu" else None
        self.ran += passes.run_passes(index, graph + weights + ([rows] if rows else []))
        if self.fused is None:  # whether row-independent attention runs: the pass rewrote every attention
            self.exact = any(r.name == ExactSums.name and r.changed for r in self.ran)
        self.minimums = fold.report if fold else None  # what the fold did, derived here, nothing written
        self.nbits8 = weights[-1].report
        self.rows = rows.plan if rows else RowPlan()
        return index

    @property
    def load_line(self) -> str:
        """The graph passes that changed the bundle's graph, in order: the fused path's load line
        ends with it (the graph as written prints none: its commands' errors stay one line)."""
        return passes.line(self.ran, f"{self.name} graph passes")

    # -- what differs between providers
    def check_available(self, ort) -> None:
        pass

    def providers(self) -> list:
        return ["CPUExecutionProvider"]

    def check_session(self) -> None:
        pass

    def make_memory(self) -> KVMemory:
        return HostMemory()

    def fused_memory(self) -> KVMemory:
        return HeadMajorMemory(FUSED_SPARE)

    def fused_refusal(self, bundle: Bundle, mode: str) -> str | None:
        """Why this provider cannot run the fused graph of `bundle` under `mode`, or None."""
        return None

    def adapt_fused(self, fused) -> list:
        """The passes that make the fused graph what this provider's kernels take (the CPU's: none)."""
        return []

    def close(self) -> None:
        pass  # onnxruntime frees its session and the host buffers with the objects

    # -- the calls: the graph's own class (PlainCalls, FusedCalls) makes them
    @property
    def windows_cache(self) -> bool:
        """A single stream's cache may keep only the local layers' window (KVCache(windowed=True)):
        the graph as written on host memory binds the ring; the fused graph (one length for every
        layer's cache) and device memory keep the full capacity."""
        return self.calls.windows_cache

    def _check_cache(self, cache: KVCache) -> None:
        if cache.memory.device != self.device or cache.layout != getattr(self.memory, "layout", "slots"):
            raise EdgeKVError(f"{self.name} needs its KV cache in its own ({self.device}, "
                              f"{getattr(self.memory, 'layout', 'slots')}-major) "
                              f"memory (build it with memory=backend.memory)")

    def run_cells(self, cache: KVCache, past: int, write: int, input_ids: np.ndarray, position_ids: np.ndarray,
                  key_mask: np.ndarray, logits_index: np.ndarray,
                  local_key_mask: np.ndarray | None = None, ring: tuple | None = None) -> np.ndarray:
        """One call over a pool of cells shared by several sequences (edgekv/runtime/batching/):
        past = cells [0, past), present written at cells [write, write + S), positions and the
        per-token mask [1, S, past + S] given whole. Cells of the write run that lie inside the
        past are free, hence masked (as a ring's overwritten slots). The same constant-work
        binding as `run`: own small arrays, the past rebound only when `past` changes. A windowed
        pool (cache.local_ring): the local layers' past is every ring's slots, local_key_mask
        [1, S, rings * local_ring + S] over them, and `ring` = (token rows, ring slots) the call's
        kept local K/V go to."""
        self._check_cache(cache)
        return self.calls.run_cells(cache, past, write, input_ids, position_ids, key_mask, logits_index,
                                    local_key_mask, ring)

    # -- serve's slots (docs/serve.md, "Fused slots"): the fused graph's calls (FusedCalls)
    def slot_memory(self, slots: int) -> SlotMemory:
        """The memory of a cache of `slots` sequence slots, for run_slots; an error where this
        backend cannot run them (the graph as written, or an onnxruntime without query_seqlens)."""
        return self.calls.slot_memory(slots)

    def run_slots(self, cache: KVCache, first: int, input_ids: np.ndarray, lengths: np.ndarray,
                  query_lengths: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        """One call over slots [first, first + B) of a slotted cache (FusedCalls.run_slots)."""
        return self.calls.run_slots(cache, first, input_ids, lengths, query_lengths, logits_index)
