"""The fused path at run time (docs/fused.md): which attention ort-cpu and ort-cuda run, the fused
graph (the fused-attention pass, edgekv/graph/passes/fused_attention.py, over the bundle's plain
graph) and its calls.

The fused graph's I/O differs from the plain contract (docs/graph.md) in the cache and the mask:

  inputs   input_ids, position_ids, logits_index (as before), seqlens_k int32 [B] (tokens in
           the cache after this call, minus 1), total_sequence_length int32 [] (their maximum),
           attention_bias float [1, 1, S, T] (T = total_sequence_length: the key mask as 0 / -inf),
           attention_bias.local (models with sliding-window layers: their local_key_mask as 0 / -inf),
           past.{i}.key / .value [B, Hkv, C, D] (BNSH, the whole buffer of capacity C)
  outputs  logits; present.{i}.key / .value [B, Hkv, C, D]: the same buffer (bound at the same
           address as past: GroupQueryAttention writes the new tokens in place)

No key_mask: GroupQueryAttention's causal rule over each entry's first seqlens_k + 1 slots is the
linear cache's mask, and attention_bias [1, 1, S, T] (0 / -inf) carries any other (a ring's
overwritten slots, the serving pool's other sequences; FusedCalls.call). The per-token int8
scheme cannot be expressed (the op has no per-token scales), nor int4's levels and rotation: those
bundles raise NotFusable, and the caller keeps the plain graph."""
from __future__ import annotations

import os

import numpy as np

from edgekv.errors import BackendUnavailable, EdgeKVError
from edgekv.format.bundle import LOCAL_MASK, Bundle
from edgekv.graph.index import GraphIndex
from edgekv.graph.passes import Changed
from edgekv.graph.passes.fused_attention import FusedAttention
from edgekv.graph.passes.fused_match import BIAS, BIAS_LOCAL, FLOAT_TYPES, SEQLENS, TOTAL, NotFusable
from edgekv.runtime.backends.base import PREFILL_CHUNK
from edgekv.runtime.backends.versions import dotted, ort_version
from edgekv.runtime.cache import KVCache
from edgekv.runtime.memory import SlotMemory

# GroupQueryAttention's CPU kernel takes an int8 cache from onnxruntime 1.27 (docs/fused.md). Older
# releases (1.23.2: the newest wheel for CPython 3.10 on aarch64, JetPack 6's Python) run the
# bundle's graph as written; pyproject's floor is the plain graph's (versions.py, tests/test_ort_versions.py)
MIN_ORT = (1, 27)


def ort_version_ok(version: str) -> bool:
    """onnxruntime `version` has GroupQueryAttention's int8-cache CPU kernel."""
    return ort_version(version) >= MIN_ORT


def ort_refusal(version: str) -> str | None:
    """Why onnxruntime `version` cannot run the fused graph (None: it can): the reason in the load
    log's line, "attention: the bundle's graph as written (...)"."""
    if ort_version_ok(version):
        return None
    return (f"onnxruntime {version} has no int8-cache GroupQueryAttention on CPU "
            f"(the fused path needs {dotted(MIN_ORT)}+)")


class FusedGraph:
    """The rewritten model and what the rewrite did (the pass's report)."""

    def __init__(self, model, rewrite: FusedAttention):
        self._model, self._bytes = model, b""
        self.rewrite = rewrite
        self.layers = rewrite.layers
        self.skip_norms = rewrite.skip_norms
        self.kind = rewrite.kind  # "float" | "static": the cache the fused graph reads and writes

    @property
    def model(self):
        """The rewritten model (once the session holds it: parsed again from its bytes, for tests
        and tools that inspect it)."""
        if self._model is None:
            import onnx

            return onnx.ModelProto.FromString(self._bytes)
        return self._model

    def serialize(self) -> bytes:
        return self._bytes if self._model is None else self._model.SerializeToString()

    def keep_only_bytes(self, graph: bytes) -> None:
        """Keep the graph as its serialized bytes only (the session's): its proto's Python objects
        are ~7x their size (25 MiB for the default model)."""
        self._model, self._bytes = None, graph


def fuse_bundle(bundle: Bundle, max_positions: int | None = None, skip_norm: bool = True) -> FusedGraph:
    """Derive the fused graph from `bundle`'s plain graph (its weights stay in the bundle's data
    file). max_positions: rows of the RoPE tables (default: the bundle's verified context)."""
    kind = bundle.scheme.kind
    if kind not in ("float", "static"):
        raise NotFusable(f"{bundle.path}: the {bundle.manifest['kv']['scheme']} KV scheme has no GroupQueryAttention "
                         f"form (the op's int8 cache takes only constant per-tensor or per-channel scales)")
    if bundle.dtype not in FLOAT_TYPES:  # the op's T: its activations, RoPE tables and bias
        raise NotFusable(f"{bundle.path}: a {bundle.dtype} graph (the fused rewrite handles {', '.join(FLOAT_TYPES)})")
    index = GraphIndex.from_path(bundle.onnx_path)
    rewrite = FusedAttention(bundle.model, kind, bundle.dtype, max_positions or bundle.max_context, skip_norm)
    rewrite.apply(index)
    return FusedGraph(index.model, rewrite)


# Which attention ort-cpu runs (docs/fused.md): "fused" = the graph rewritten at load into
# onnxruntime's GroupQueryAttention per layer (static int8 or float caches), "plain" = the
# bundle's graph as written, "auto" = fused for a static int8 cache, the graph as written for
# the rest (a float cache is the reference eval compares against; per-token scales have no fused form)
ATTENTION_ENV = "EDGEKV_ATTENTION"
ATTENTIONS = ("auto", "fused", "plain")
# query_seqlens (onnxruntime 1.32): each entry's valid tokens of a right-padded call; 0 = an idle
# entry whose cache is unchanged. Fed by every fused call ([S] for one stream, where it is what the
# op assumes without it), so one graph serves a stream and serve's slots (run_slots)
QUERY_LENGTHS = "query_seqlens"
QUERY_LENGTHS_INPUT = 16  # its place among GroupQueryAttention's inputs
QUERY_LENGTHS_ORT = (1, 32)  # the release whose schema has it
FUSED_INPUTS = (SEQLENS, TOTAL, BIAS)
# slots after the capacity where a fused call writing inside the past lands before it is moved
# (a ring's overwrite, a pool's cell run), and so the most tokens a fused call takes (the
# engine's steps keep to max_tokens_per_call): two prompt chunks
FUSED_SPARE = 2 * PREFILL_CHUNK


def attention_default() -> str:
    value = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if value not in ATTENTIONS:
        raise EdgeKVError(f"{ATTENTION_ENV}={value!r}: choose one of {', '.join(ATTENTIONS)}")
    return value


def choose_attention(backend, bundle: Bundle, asked: str | None):
    """(the fused graph or None, the load log's line: which attention runs and why) for the
    attention `asked` (None: EDGEKV_ATTENTION's). `fused` where it cannot be built is an error;
    `auto` then keeps the graph as written. The line names EDGEKV_ATTENTION=plain as the way out
    only where the variable chose: a caller that asked (serve, by --slots) names its own."""
    mode = attention_default() if asked is None else asked
    if mode not in ATTENTIONS:
        raise EdgeKVError(f"attention {mode!r}: choose one of {', '.join(ATTENTIONS)}")
    if mode == "plain":
        return None, f"attention: the bundle's graph as written ({ATTENTION_ENV}=plain)"
    why = None
    if not backend.fuses:
        why = f"{backend.name} runs the graph as written (the fused rewrite targets onnxruntime's CPU kernels)"
    elif (refused := backend.fused_refusal(bundle, mode)) is not None:  # the provider's own limits (ort-cuda)
        why = refused
    elif mode == "auto" and bundle.scheme.kind != "static":  # the bundle's reason first: no release fuses it
        why = (f"the {bundle.scheme.name} KV scheme runs the graph as written"
               + (" (a float cache is the reference; EDGEKV_ATTENTION=fused fuses it)" if bundle.scheme.kind == "float"
                  else " (GroupQueryAttention takes only static scales)"))
    if why is None:
        try:
            fused = fuse_bundle(bundle, max_positions=bundle.max_context + FUSED_SPARE)
        except NotFusable as e:
            why = str(e)
        else:
            # the release last: what the bundle cannot express is said on any (JetPack 6's cp310: 1.23.2)
            why = ort_refusal(backend.ort.__version__)
        if why is None:
            way_out = f"; {ATTENTION_ENV}=plain runs the graph as written" if asked is None else ""
            return fused, (f"attention: fused (GroupQueryAttention in each of {len(fused.layers)} layers, "
                           f"{fused.skip_norms} SkipSimplifiedLayerNormalization{way_out})")
    if mode == "fused":
        raise BackendUnavailable(f"fused attention: {why}")
    return None, f"attention: the bundle's graph as written ({why})"


def ort_at_least(version: str, floor: tuple[int, int]) -> bool:
    """onnxruntime `version` (\"1.32.0\", \"1.33.0.dev...\") is `floor` or later."""
    return ort_version(version) >= floor


def with_query_lengths(model) -> None:
    """Every GroupQueryAttention of the fused model (in place) reads the graph input query_seqlens [B]."""
    import onnx

    for n in model.graph.node:
        if n.op_type == "GroupQueryAttention":
            n.input.extend([""] * (QUERY_LENGTHS_INPUT - len(n.input)) + [QUERY_LENGTHS])
    model.graph.input.append(onnx.helper.make_tensor_value_info(QUERY_LENGTHS, onnx.TensorProto.INT32, ["batch"]))


class QueryLengths:
    """query-lengths: the fused graph's GroupQueryAttentions read query_seqlens (serve's slots)."""
    name = "query-lengths"

    def apply(self, index) -> Changed:
        with_query_lengths(index.model)
        return Changed(True)


def attention_bias(key_mask: np.ndarray, past: int, at: int, s: int) -> np.ndarray:
    """GroupQueryAttention's attention_bias [1, 1, S, at + S] for a call whose past is slots
    [0, past) under key_mask [1, S, past + S] and whose new tokens the op places at slot `at`
    (>= past): 0 where a token sees a key, -inf where not, slots [past, at) hidden."""
    bias = np.full((1, 1, s, at + s), -np.inf, np.float32)
    bias[0, 0, :, :past][key_mask[0, :, :past]] = 0.0
    bias[0, 0, :, at:][key_mask[0, :, past:]] = 0.0
    return bias


def slot_window_bias(positions: np.ndarray, slots: int, window: int) -> np.ndarray:
    """The sliding-window layers' bias [B, 1, S, slots] for entries whose cell j holds position j
    (serve's slots): 0 where q_pos - j < window, -inf where not (the op's causal rule hides j > q_pos)."""
    d = positions[:, None, :, None] - np.arange(slots)[None, None, None, :]  # [B, 1, S, slots]
    return np.where(d < window, np.float32(0.0), np.float32(-np.inf))



class FusedCalls:
    """The fused graph's calls (docs/fused.md, "The runtime"): the cache is head-major, one buffer
    per tensor bound whole as both past and present; GroupQueryAttention reads the first
    seqlens_k + 1 slots, adds attention_bias (the key mask as 0 / -inf) and writes the new tokens at
    slot seqlens_k + 1 - S. `be`: the backend (its session, binding, memory, flags)."""
    past_bucket = 1  # the whole buffer is bound; the op reads only seqlens_k + 1 slots: no bucket
    max_tokens_per_call = FUSED_SPARE
    windows_cache = False  # one length for every layer's cache

    def __init__(self, be):
        self.be = be
        self._zero: np.ndarray | None = None  # run_slots' attention_bias of zeros, for its last shape

    def memory(self):
        return self.be.fused_memory()

    def expected_inputs(self, bundle: Bundle) -> set[str]:
        """The session's inputs: the cache's lengths and the biases in place of the masks."""
        expected = set(bundle.manifest["io"]["inputs"]) | set(bundle.manifest["io"]["past"])
        local = {BIAS_LOCAL} if LOCAL_MASK in expected else set()
        return ((expected - {"key_mask", LOCAL_MASK}) | set(self.be.fused_inputs) | local
                | ({QUERY_LENGTHS} if self.be.query_lengths else set()))

    def run_cells(self, cache: KVCache, past: int, write: int, input_ids: np.ndarray, position_ids: np.ndarray,
                  key_mask: np.ndarray, logits_index: np.ndarray,
                  local_key_mask: np.ndarray | None = None, ring: tuple | None = None) -> np.ndarray:
        return self.call(cache, past, write, input_ids, position_ids, key_mask, logits_index, local_key_mask)

    def call(self, cache: KVCache, past: int, write: int, input_ids: np.ndarray, position_ids: np.ndarray,
             key_mask: np.ndarray, logits_index: np.ndarray,
             local_key_mask: np.ndarray | None = None) -> np.ndarray:
        """past = slots [0, past) seen through key_mask [1, S, past + S], the new tokens' K/V to
        slots [write, write + S). The op writes at the end of what it reads, so a call whose
        write slot is not `past` (a ring overwriting, a cell run elsewhere in a pool, or a first
        prompt whose positions do not run on: the op reads only position_ids[0] then) runs over
        the whole capacity with the rest masked, writes to the spare slots after it and is moved
        to its cells. local_key_mask [1, S, past + S]: the sliding-window layers' keys (a graph with them needs it), their bias built the same way."""
        be, s = self.be, input_ids.shape[1]
        if be.local_bias and local_key_mask is None:
            raise EdgeKVError(f"{be.name}: this graph has sliding-window layers and needs their {LOCAL_MASK}")
        runs_on = bool(np.all(np.diff(position_ids[0]) == 1))
        direct = write == past and (past > 0 or runs_on)
        at = past if direct else cache.capacity  # where the op writes
        if not direct and s > be.memory.spare:
            raise EdgeKVError(f"{be.name} (fused attention): a call of {s} tokens written inside the past "
                              f"exceeds the {be.memory.spare} spare cells (EDGEKV_ATTENTION=plain runs it)")
        feeds = {"input_ids": np.ascontiguousarray(input_ids, np.int64),
                 "position_ids": np.ascontiguousarray(position_ids, np.int64),
                 "logits_index": np.ascontiguousarray(logits_index, np.int64),
                 SEQLENS: np.array([at + s - 1], np.int32), TOTAL: np.array(at + s, np.int32),
                 BIAS: attention_bias(key_mask, past, at, s)}
        if be.local_bias:
            feeds[BIAS_LOCAL] = attention_bias(local_key_mask, past, at, s)
        if be.query_lengths:
            feeds[QUERY_LENGTHS] = np.array([s], np.int32)
        be.binding.feeds(feeds)
        be.binding.whole_cache(cache)
        logits = be.binding.logits_for(1, logits_index.shape[1])
        be.binding.run(be.session)
        if at != write:
            self.move_slots(cache, at, write, s)
        return logits

    def move_slots(self, cache: KVCache, src: int, dst: int, n: int) -> None:
        """A moved call's new tokens from the spare slots [src, src + n) to their cells [dst, dst + n)."""
        for buf in cache.buffers.values():  # [1, Hkv, slots, D]
            buf[0, :, dst: dst + n] = buf[0, :, src: src + n]

    # -- serve's slots (docs/serve.md, "Fused slots"): the cache is SlotMemory's [K, Hkv, L, D];
    # a call is entries of consecutive slots, each appending its own tokens at its own length
    def slot_memory(self, slots: int) -> SlotMemory:
        """The memory of a cache of `slots` sequence slots, for run_slots; an error where this
        backend cannot run them (the graph as written, or an onnxruntime without query_seqlens)."""
        if not self.be.query_lengths:
            raise BackendUnavailable(f"fused slots need GroupQueryAttention's query_seqlens: onnxruntime "
                                     f">= {'.'.join(map(str, QUERY_LENGTHS_ORT))} (this is {self.be.ort.__version__})")
        return SlotMemory(slots)

    def run_slots(self, cache: KVCache, first: int, input_ids: np.ndarray, lengths: np.ndarray,
                  query_lengths: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        """One call over slots [first, first + B) of a slotted cache: entry b holds lengths[b]
        tokens and appends its first query_lengths[b] rows of input_ids [B, S] (right-padded; 0:
        idle, its slot unchanged) at its own positions lengths[b] + i. Each entry reads only its
        own slot, from cell 0, whatever else the call holds (batched = alone, docs/serve.md).
        Returns logits [B, K, V] of rows logits_index [B, K]."""
        be = self.be
        if cache.layout != SlotMemory.layout:
            raise EdgeKVError(f"{be.name}: run_slots needs a slotted cache (memory=backend.slot_memory(k))")
        b, s = input_ids.shape
        slot_len = cache.memory.slot_length(cache.capacity)  # (a device buffer's shape is not an attribute)
        lengths = np.asarray(lengths, np.int64)
        query = np.asarray(query_lengths, np.int32)
        # an idle entry still needs seqlens_k >= 0; its cache is left as it is
        seqlens = np.maximum(lengths + query - 1, 0).astype(np.int32)
        feeds = {"input_ids": np.ascontiguousarray(input_ids, np.int64),
                 "position_ids": lengths[:, None] + np.arange(s, dtype=np.int64)[None],
                 "logits_index": np.ascontiguousarray(logits_index, np.int64),
                 # the slot's length as the total: a bound (query_seqlens gives each entry's own), the
                 # same in every call, so nothing in an entry's arithmetic depends on its batch
                 SEQLENS: seqlens, TOTAL: np.array(slot_len, np.int32), QUERY_LENGTHS: query,
                 BIAS: self._zero_bias(s, slot_len)}
        if be.local_bias:  # a slot's cell j holds position j: the window by position is by cell here
            feeds[BIAS_LOCAL] = slot_window_bias(feeds["position_ids"], slot_len, be.window)
        be.binding.feeds(feeds)
        be.binding.slot_block(cache, first, b)
        logits = be.binding.logits_for(b, logits_index.shape[1])
        be.binding.run(be.session)
        return logits

    def _zero_bias(self, s: int, total: int) -> np.ndarray:
        """attention_bias [1, 1, S, T] of zeros (a slot's entry sees its own cells, causally: the op's rule)."""
        if self._zero is None or self._zero.shape != (1, 1, s, total):
            self._zero = np.zeros((1, 1, s, total), np.float32)
        return self._zero
