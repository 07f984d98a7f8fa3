"""The onnxruntime backends (edgekv/runtime/backends/base.py has the protocol they follow):
ort-cpu (host memory); ort-cuda, its subclass for device memory, is ort_cuda.py.

A decode step's host work is constant (docs/runtime.md, "The decode step"): the past is bound at
its filled slots rounded up to PAST_BUCKET, the tail masked through key_mask, so its ~60 bindings
change once per bucket; the small inputs are arrays of the backend's own, bound once per shape
and overwritten in place; a one-token call's present.* land in staging buffers bound once per
cache and are copied to the write slot after the run (ort-cpu), instead of being rebound there."""
from __future__ import annotations

import ctypes
import os

import numpy as np

from edgekv.errors import BackendUnavailable, BundleError, EdgeKVError, note
from edgekv.format.bundle import LOCAL_MASK, Bundle
from edgekv.runtime.backends.base import PREFILL_CHUNK, UNLIMITED, bound_past, default_threads
from edgekv.runtime.backends.binding import Binding
from edgekv.runtime.backends.fused import (BIAS, BIAS_LOCAL, SEQLENS, TOTAL, NotFusable, fuse_bundle,
                                           ort_refusal)
from edgekv.runtime.backends.forms import unpack_forms
from edgekv.runtime.backends.nbits import fold_graph
from edgekv.runtime.backends.nbits8 import fuse_8bit
from edgekv.runtime.backends.rows import RowPlan, exact_rows
from edgekv.runtime.backends.versions import ort_version, too_old
from edgekv.runtime.cache import KVCache
from edgekv.runtime.memory import HeadMajorMemory, HostMemory, KVMemory, SlotMemory
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


# Row-independent attention (`exact`, the default; docs/weights.md, "Temperature 0"). onnxruntime's
# Softmax sums a row in vector lanes fixed by each element's place in memory, and its MatMul sums
# the cells in blocks of 256: where a sequence's cells lie in the pool, how long the bound past is
# and which row of the call it is all change the rounding of its attention by an ulp, and the int8
# rounding that follows (the cache's codes, the fused kernel's activations) turns that ulp into a
# different greedy token. Summed in fixed point instead, every term a multiple of one power of two
# and every partial sum exactly representable, the sums are the same in any order and layout.
# EDGEKV_EXACT=0 runs the graph as written (faster prefill, batch-dependent greedy text).
EXACT_ENV = "EDGEKV_EXACT"


def exact_default() -> bool:
    return os.environ.get(EXACT_ENV, "1").strip() not in ("0", "false", "no", "off")
LIMB_BITS, LIMBS = 7, 3  # value codes: 21 bits a row's largest weight, as three 7-bit bytes
TOP = 2 ** (LIMB_BITS * LIMBS) - 2  # a row's largest weight's code (one below 2**21 - 1: rounding)


class ExactAttention:
    """Rewrites a bundle's graph (in place) so that each token's attention depends only on its own
    cells' values and their order:

    - softmax: exp(x - max) * 2**exp_bits floored to integers, their row sum in double (exact: the
      sum stays below 2**53), one division;
    - values: the weights (probability x value scale, >= 0) as integer codes
      round(w * TOP / rowmax), their three 7-bit bytes against the cache's int8 codes in one
      onnxruntime u8 x s8 MatMul over the past and new cells together (int32: exact, and no 16-bit
      pair sum above 2 * 127 * 128, so no saturation on any CPU path), the bytes combined in double,
      one rounding to float32.

    `applied` says whether every attention of the graph was rewritten; the graph is changed only
    then. A graph whose values are not integer codes (a float or int4 cache) is left as written."""

    def __init__(self, model, max_cells: int):
        import onnx
        from onnx import numpy_helper

        self.onnx, self.model, self.g, self.T = onnx, model, model.graph, onnx.TensorProto
        self.to_array = numpy_helper.to_array
        terms = (2 * max(1, max_cells) - 1).bit_length()  # log2 of a row's terms: past cells + new tokens
        self.exp_bits = 52 - terms
        # int32 sums of 127 * 128 * terms; beyond 2**17 terms a row the bytes could overflow
        self.fits = terms <= 31 - 2 * LIMB_BITS
        self.prod = {o: n for n in self.g.node for o in n.output}
        self.uses: dict[str, list] = {}
        for n in self.g.node:
            for i in n.input:
                self.uses.setdefault(i, []).append(n)
        self.consts = {t.name: t for t in self.g.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
        self.inputs = {i.name: i.type.tensor_type.elem_type for i in self.g.input}
        self._ranks: dict[str, int] | None = None
        self.applied = self.fits and self._rewrite()

    # -- reading the graph
    def _value(self, name: str):
        """A constant's value (an initializer or a Constant node), else None."""
        if (t := self.consts.get(name)) is not None:
            return self.to_array(t)
        n = self.prod.get(name)
        if n is not None and n.op_type == "Constant" and n.attribute:
            v = self.onnx.helper.get_attribute_value(n.attribute[0])
            return self.to_array(v) if isinstance(v, self.onnx.TensorProto) else np.asarray(v)
        return None

    def _scalar(self, name: str):
        v = self._value(name)
        return float(v) if v is not None and v.ndim == 0 else None

    def _ints(self, name: str):
        v = self._value(name)
        return v.tolist() if v is not None and v.ndim == 1 else None

    def _rank(self, name: str) -> int:
        if self._ranks is None:
            from onnx import shape_inference
            inferred = shape_inference.infer_shapes(self.model).graph.value_info
            self._ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in inferred if v.type.tensor_type.HasField("shape")}
        return self._ranks.get(name, -1)

    def _int8_read(self, name: str) -> str | None:
        """The int8 graph input `name` is a read of (Cast, or DequantizeLinear with unit scale)."""
        n = self.prod.get(name)
        if n is None or n.op_type not in ("Cast", "DequantizeLinear") or self.inputs.get(n.input[0]) != self.T.INT8:
            return None
        if n.op_type == "DequantizeLinear" and not (self._scalar(n.input[1]) == 1.0 and (
                len(n.input) < 3 or not n.input[2] or self._scalar(n.input[2]) == 0.0)):
            return None
        return n.input[0]

    def _int8_values(self, b: str) -> tuple[list, str] | None:
        """The value operand as int8 codes: the cache's own codes reshaped (no float copy of the
        past), or the new tokens' Clip(Round(.), -127, 127) cast back; None if b is not codes."""
        r = self.prod.get(b)
        if r is not None and r.op_type == "Reshape":
            if (x := self._int8_read(r.input[0])) is not None:
                return [self._node("Reshape", [x, r.input[1]], b + "/exact_i8")], b + "/exact_i8"
            c = self.prod.get(r.input[0])
            if c is not None and c.op_type == "Clip" and len(c.input) == 3 and (src := self.prod.get(c.input[0])) is not None \
                    and src.op_type == "Round" and all(v is not None and abs(v) <= 127 for v in map(self._scalar, c.input[1:])):
                return [self._node("Cast", [b], b + "/exact_i8", to=self.T.INT8)], b + "/exact_i8"
        return None

    def _products(self) -> dict[str, list] | None:
        """Value products grouped by the weights they are sliced from (MatMuls whose first operand
        is the softmax's output through Reshape/Mul/Slice), None if any is not one."""
        softmaxes = [n for n in self.g.node if n.op_type == "Softmax"]
        if not softmaxes or any(a.name == "axis" and a.i != -1 for n in softmaxes for a in n.attribute):
            return None
        flow = {n.output[0] for n in softmaxes}
        for n in self.g.node:  # topological order
            if n.op_type in ("Reshape", "Mul", "Slice") and any(i in flow for i in n.input[:2]):
                flow.update(n.output)
        groups: dict[str, list] = {}
        for n in self.g.node:
            if n.op_type == "MatMul" and n.input[0] in flow:
                a = n.input[0]
                s = self.prod.get(a)
                src = s.input[0] if s is not None and s.op_type == "Slice" else a
                groups.setdefault(src, []).append(n)
        return groups or None

    def _split(self, src: str, mms: list):
        """A source's products as (the output they are replaced at, the products): one product of
        the whole row, or the past's [0:P] and the new tokens' [P:] added."""
        if len(mms) == 1 and mms[0].input[0] == src:
            return mms[0].output[0], [mms[0]]
        if len(mms) != 2:
            return None
        adds = {c.output[0] for n in mms for c in self.uses.get(n.output[0], [])}
        if len(adds) != 1 or any(len(self.uses.get(n.output[0], [])) != 1 for n in mms):
            return None
        add = self.prod[adds.pop()]
        if add.op_type != "Add" or sorted(add.input) != sorted(n.output[0] for n in mms):
            return None
        first, second = (self.prod[n.input[0]] for n in mms)
        last = [-1, self._rank(src) - 1]
        ok = all(s.op_type == "Slice" and len(s.input) >= 4 and self._ints(s.input[3]) in ([last[0]], [last[1]])
                 and (len(s.input) < 5 or not s.input[4] or self._ints(s.input[4]) == [1]) for s in (first, second))
        if not (ok and self._ints(first.input[1]) == [0] and (self._ints(second.input[2]) or [0])[0] >= 2 ** 62):
            return None  # not the partition [0:P] + [P:]: the row's cells would not be summed whole
        return add.output[0], mms

    # -- writing the graph
    def _const(self, name: str, value, dtype=np.float32) -> str:
        if name not in self.consts:
            t = self.onnx.numpy_helper.from_array(np.asarray(value, dtype), name)
            self.g.initializer.append(t)
            self.consts[name] = t
        return name

    def _node(self, op: str, inputs: list[str], output: str, **attrs):
        return self.onnx.helper.make_node(op, inputs, [output], name=output, **attrs)

    def _rewrite(self) -> bool:
        groups = self._products()
        if groups is None:
            return False
        plans = []
        for src, mms in groups.items():
            split = self._split(src, mms)
            values = [self._int8_values(n.input[1]) for n in mms]
            if split is None or None in values:
                return False
            plans.append((src, split, values))
        replace: dict[str, list] = {}  # a node (by its first output) -> what replaces it
        for n in self.g.node:
            if n.op_type == "Softmax":
                replace[n.output[0]] = self._softmax(n)
        for src, (out, mms), values in plans:
            gone = [n.output[0] for n in mms] + [n.input[0] for n in mms if n.input[0] != src]
            for name in gone:
                replace[name] = []
            replace[out] = [node for nodes, _ in values for node in nodes] + self._product(src, out, [v for _, v in values])
        nodes = [m for n in self.g.node for m in replace.get(n.output[0], [n])]
        del self.g.node[:]
        self.g.node.extend(nodes)
        return True

    def _softmax(self, n) -> list:
        """exp(x - max) * 2**exp_bits (as exp(x - (max - exp_bits ln 2)): elementwise, the same
        wherever the element lies), floored, summed in double (exact), one division."""
        x, y, p = n.input[0], n.output[0], n.output[0] + "/exact_"
        axes = self._const("exact/last_axis", [-1], np.int64)
        shift = self._const("exact/exp_shift", self.exp_bits * np.log(2.0))
        return [self._node("ReduceMax", [x, axes], p + "max", keepdims=1),
                self._node("Sub", [p + "max", shift], p + "max_shifted"),
                self._node("Sub", [x, p + "max_shifted"], p + "centred"),
                self._node("Exp", [p + "centred"], p + "scaled"),
                self._node("Floor", [p + "scaled"], p + "fixed"),
                self._node("Cast", [p + "fixed"], p + "fixed_d", to=self.T.DOUBLE),
                self._node("ReduceSum", [p + "fixed_d", axes], p + "sum_d", keepdims=1),
                self._node("Cast", [p + "sum_d"], p + "sum", to=self.T.FLOAT),
                self._node("Div", [p + "scaled", p + "sum"], y)]

    def _bytes(self, p: str) -> list:
        """codes -> their 7-bit bytes, stacked on a new first axis as uint8 (p + "limbs"), computed
        in float32 (exact below 2**24; onnxruntime's float kernels outrun its bit ops):
        over_i = floor(codes / 2**(7 i)), byte_i = over_i - 128 over_(i+1), the last byte over_i."""
        c = lambda name, v, dt=np.float32: self._const("exact/" + name, v, dt)  # noqa: E731
        over = [p + "codes"] + [p + f"over{i}" for i in range(1, LIMBS)]
        nodes = []
        for i in range(1, LIMBS):
            nodes += [self._node("Mul", [p + "codes", c(f"inv_base{i}", 2.0 ** (-LIMB_BITS * i))], over[i] + "_f"),
                      self._node("Floor", [over[i] + "_f"], over[i])]
        limbs = []
        for i in range(LIMBS):
            byte = over[i]
            if i < LIMBS - 1:
                nodes += [self._node("Mul", [over[i + 1], c("base", 2.0 ** LIMB_BITS)], over[i + 1] + "_up"),
                          self._node("Sub", [over[i], over[i + 1] + "_up"], p + f"byte{i}")]
                byte = p + f"byte{i}"
            nodes += [self._node("Unsqueeze", [byte, c("first_axis", [0], np.int64)], byte + "_1"),
                      self._node("Cast", [byte + "_1"], byte + "_u8", to=self.T.UINT8)]
            limbs.append(byte + "_u8")
        return nodes + [self._node("Concat", limbs, p + "limbs", axis=0)]

    def _product(self, src: str, out: str, values: list[str]) -> list:
        """out = src @ concat(values): the weights' codes as 7-bit bytes (stacked on a new first
        axis) against the int8 codes, combined in double, times rowmax / TOP."""
        p, T = out + "/exact_", self.T
        c = lambda name, v, dt=np.float32: self._const("exact/" + name, v, dt)  # noqa: E731
        stack = [LIMBS] + [1] * self._rank(src)  # the bytes' axis, broadcast against the row's
        nodes = [self._node("ReduceMax", [src, c("last_axis", [-1], np.int64)], p + "rowmax", keepdims=1),
                 self._node("Max", [p + "rowmax", c("floor", 1e-30)], p + "unit"),  # a row of zeros stays zeros
                 self._node("Div", [c("top", float(TOP)), p + "unit"], p + "up"),
                 self._node("Mul", [src, p + "up"], p + "rel_top"),  # <= TOP (1 + 2**-24): below 2**21
                 self._node("Round", [p + "rel_top"], p + "codes")]
        nodes += self._bytes(p)
        if len(values) > 1:
            nodes.append(self._node("Concat", values, p + "values", axis=-2))
        weights = c(f"limb_weights_{len(stack)}", (2.0 ** (LIMB_BITS * np.arange(LIMBS))).reshape(stack), np.float64)
        return nodes + [
            self._node("MatMulInteger", [p + "limbs", p + "values" if len(values) > 1 else values[0]], p + "sums_i"),
            self._node("Cast", [p + "sums_i"], p + "sums_d", to=T.DOUBLE),  # int32: exact
            self._node("Mul", [p + "sums_d", weights], p + "sums_w"),
            self._node("ReduceSum", [p + "sums_w", c("first_axis", [0], np.int64)], p + "total_d", keepdims=0),  # < 2**53: exact
            self._node("Cast", [p + "total_d"], p + "total", to=T.FLOAT),
            self._node("Div", [p + "unit", c("top", float(TOP))], p + "back"),
            self._node("Mul", [p + "total", p + "back"], out)]


def exact_graph(graph: bytes, max_cells: int) -> tuple[bytes, bool]:
    """The graph with row-independent attention, and whether it could be rewritten (else as given)."""
    import onnx

    model = onnx.load_from_string(graph)
    if max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0) < 18:
        return graph, False  # ReduceMax takes its axes as an input, Split num_outputs, from opset 18
    if not ExactAttention(model, max_cells).applied:
        return graph, False
    return model.SerializeToString(), True


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
# engine's steps and the generator's chunks keep to max_tokens_per_call): two prompt chunks
FUSED_SPARE = 2 * PREFILL_CHUNK


def attention_default() -> str:
    value = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if value not in ATTENTIONS:
        raise EdgeKVError(f"{ATTENTION_ENV}={value!r}: choose one of {', '.join(ATTENTIONS)}")
    return value


def choose_attention(backend: "OrtBackend", bundle: Bundle, asked: str | None):
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


def attention_bias(key_mask: np.ndarray | None, past: int, at: int, s: int) -> np.ndarray:
    """GroupQueryAttention's attention_bias [1, 1, S, at + S] for a call whose past is slots
    [0, past) under key_mask [1, S, past + S] and whose new tokens the op places at slot `at`
    (>= past): 0 where a token sees a key, -inf where not, slots [past, at) hidden."""
    if key_mask is None and at == past:
        return np.zeros((1, 1, s, at + s), np.float32)  # the op's own causal rule is the mask
    bias = np.full((1, 1, s, at + s), -np.inf, np.float32)
    if key_mask is None:
        bias[0, 0, :, :past] = 0.0
        bias[0, 0, :, at:] = 0.0
    else:
        bias[0, 0, :, :past][key_mask[0, :, :past]] = 0.0
        bias[0, 0, :, at:][key_mask[0, :, past:]] = 0.0
    return bias


def slot_window_bias(positions: np.ndarray, slots: int, window: int) -> np.ndarray:
    """The sliding-window layers' bias [B, 1, S, slots] for entries whose cell j holds position j
    (serve's slots): 0 where q_pos - j < window, -inf where not (the op's causal rule hides j > q_pos)."""
    d = positions[:, None, :, None] - np.arange(slots)[None, None, None, :]  # [B, 1, S, slots]
    return np.where(d < window, np.float32(0.0), np.float32(-np.inf))


def session_options(ort, threads: int | None, matmul_accuracy: int):
    """The CPU session's options, for the graph as written and for derived (fused) graphs alike."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads or default_threads()
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    # a memory plan per input shape: decode steps repeat a few shapes (the past is bound in
    # buckets), and one planned block per run is ~10 % faster than a node-by-node arena (docs/graph.md)
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
    # a GGUF minimum term's integer part becomes MatMulNBits' zero points (nbits.py: on its rounded activations)
    fold_minimums = True
    fused_inputs = FUSED_INPUTS  # what the fused graph reads beside the bundle's own inputs
    runs_slots = True  # serve's fused slots (run_slots: query_seqlens, which the CPU kernel reads)
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
        try:
            if self.fused is not None:
                self.adapt_fused(self.fused)
            # serve's slots need query_seqlens (onnxruntime >= 1.32); without it the fused graph
            # still runs one stream, and run_slots says why it cannot run
            self.query_lengths = (self.fused is not None and self.runs_slots
                                  and ort_at_least(ort.__version__, QUERY_LENGTHS_ORT))
            if self.query_lengths:
                with_query_lengths(self.fused.model)
            if self.fused is not None:
                graph, self.exact = self.fused.serialize(), False  # GroupQueryAttention sums as it does
            else:
                graph = cast_cache_reads(bundle.onnx_path)
                # row-independent attention (default: EDGEKV_EXACT, on); self.exact: whether it runs
                want = self.exact_attention and (exact_default() if exact is None else exact)
                graph, self.exact = exact_graph(graph, bundle.max_context) if want else (graph, False)
            self.minimums = None  # what the fold did (None: not tried), derived here, nothing written
            if self.fold_minimums:
                graph, self.minimums = fold_graph(graph, str(bundle.onnx_path.parent))
                self._handed = self.minimums.hand_to(ort, opts)  # the remainders, by reference
            graph, unpacked = unpack_forms(graph, str(bundle.onnx_path.parent))  # packed codes: ours, not folded by onnxruntime
            # 8-bit block weights as MatMulNBits where onnxruntime < 1.25 does not fuse them itself (nbits8.py;
            # self.nbits8.line(): the load log's, where its kernel does not run them either)
            graph, unpacked, self.nbits8 = fuse_8bit(graph, str(bundle.onnx_path.parent), unpacked, ort,
                                                     matmul_accuracy, self.device)
            self._unpacked = unpacked.hand_to(ort, opts)  # by reference, as long as the session lives
            # weight products whose rows do not depend on the call's row count on this CPU (rows.py)
            graph, self.rows = (exact_rows(graph, opts.intra_op_num_threads, matmul_accuracy)
                                if self.device == "cpu" else (graph, RowPlan()))
            # the rewritten graph comes as bytes: its weights are still found beside model.onnx
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                          str(bundle.onnx_path.parent))
            self.session = ort.InferenceSession(graph, opts, providers=self.providers(), disabled_optimizers=off)
        except Exception as e:  # onnxruntime raises its own exception types for a bad file
            raise load_refusal(bundle, e) from None
        self.check_session()
        if self.fused is not None:  # a path new to the user: the load log says it runs, and how to leave it
            note(self.attention)
        if (line := self.rows.line()) is not None:
            note(line)
        self.vocab = bundle.model["vocab_size"]
        self.window = bundle.window  # the sliding-window layers' (None without them)
        self.binding = Binding(self.session, self.device, self.vocab, max_logits_rows)
        graph_inputs = {i.name for i in self.session.get_inputs()}
        self.local_mask = LOCAL_MASK in graph_inputs  # a model with sliding-window layers: their mask is fed too
        self.local_bias = BIAS_LOCAL in graph_inputs  # ... and, fused, their bias (docs/fused.md, "Architectures")
        expected = set(bundle.manifest["io"]["inputs"]) | set(bundle.manifest["io"]["past"])
        if self.fused is not None:  # the cache's lengths and the biases in place of the masks
            local = {BIAS_LOCAL} if LOCAL_MASK in expected else set()
            expected = ((expected - {"key_mask", LOCAL_MASK}) | set(self.fused_inputs) | local
                        | ({QUERY_LENGTHS} if self.query_lengths else set()))
        if graph_inputs != expected:
            raise BundleError(f"{bundle.path}: corrupt bundle (graph inputs do not match the manifest)")
        self.memory = self.make_memory() if self.fused is None else self.fused_memory()
        # the fused graph binds the whole buffer and reads only seqlens_k + 1 slots: no bucket
        self.past_bucket = past_bucket if self.fused is None else 1
        if self.fused is not None:
            self.max_tokens_per_call = FUSED_SPARE
        self._zero: np.ndarray | None = None  # run_slots' attention_bias of zeros, for its last shape

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

    def adapt_fused(self, fused) -> None:
        """The fused graph as this provider's kernels take it (in place; the CPU's: as built)."""

    def close(self) -> None:
        pass  # onnxruntime frees its session and the host buffers with the objects

    def past_slots(self, cache: KVCache, seq: Sequence) -> int:
        """Slots bound as the past: the filled ones rounded up to the bucket (capped at the
        capacity), so the binding changes once per bucket; the sequence's key mask hides the rest."""
        return bound_past(seq.n, self.past_bucket, cache.capacity)

    @property
    def windows_cache(self) -> bool:
        """A single stream's cache may keep only the local layers' window (KVCache(windowed=True)):
        the graph as written on host memory binds the ring; the fused graph (one length for every
        layer's cache) and device memory keep the full capacity."""
        return self.fused is None and self.device == "cpu"

    def run(self, cache: KVCache, seq: Sequence, input_ids: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        self._check_cache(cache)
        s = input_ids.shape[1]
        if self.fused is not None:  # a single stream appends: the op's own causal rule over the filled slots
            local = seq.local_key_mask(s, seq.n) if self.local_bias else None  # the window: never the op's rule
            return self._run_fused(cache, seq.n, seq.n, input_ids, seq.positions(s), None, logits_index, local)
        past = self.past_slots(cache, seq)
        if cache.local_ring is not None:  # the local layers' ring, bound at its own bucket
            return self._run(cache, past, seq.n, input_ids, seq.positions(s), seq.key_mask(s, past), logits_index,
                             *self._ring_call(cache, seq, s))
        local = seq.local_key_mask(s, past) if self.local_mask else None
        return self._run(cache, past, seq.n, input_ids, seq.positions(s), seq.key_mask(s, past), logits_index, local)

    def _ring_call(self, cache: KVCache, seq: Sequence, s: int) -> tuple:
        """A windowed cache's local layers: (their mask, the slots bound as their past, where the
        call's kept tokens go: the first kept and their ring slots)."""
        if cache.local_ring != seq.local_ring:
            raise EdgeKVError(f"{self.name}: a windowed cache runs its own sequences (cache.new_sequence())")
        local_past = bound_past(seq.local_filled(), self.past_bucket, cache.local_ring)
        first, slots = seq.local_slots(s)
        return seq.local_key_mask(s, local_past), local_past, (np.arange(first, s), slots)

    def _check_cache(self, cache: KVCache) -> None:
        if cache.memory.device != self.device or cache.layout != getattr(self.memory, "layout", "slots"):
            raise EdgeKVError(f"{self.name} needs its KV cache in its own ({self.device}, "
                              f"{getattr(self.memory, 'layout', 'slots')}-major) "
                              f"memory (build it with memory=backend.memory)")

    def _run(self, cache: KVCache, past: int, write: int, input_ids: np.ndarray, position_ids: np.ndarray,
             key_mask: np.ndarray, logits_index: np.ndarray, local_key_mask: np.ndarray | None = None,
             local_past: int | None = None, ring: tuple | None = None) -> np.ndarray:
        """One graph call: past = slots [0, past), present to slots [write, write + S); a windowed
        cache's local layers: past = their slots [0, local_past), and the call's token rows ring[0]
        go to their ring slots ring[1]."""
        b, s = input_ids.shape
        small = self.binding.small(s, logits_index.shape[1], past, self.local_mask, local_past)
        np.copyto(small["input_ids"], input_ids)
        np.copyto(small["position_ids"], position_ids)
        np.copyto(small["logits_index"], logits_index)
        np.copyto(small["key_mask"], key_mask)
        if self.local_mask:
            if local_key_mask is None:
                raise EdgeKVError(f"{self.name}: this graph has sliding-window layers and needs their {LOCAL_MASK}")
            np.copyto(small[LOCAL_MASK], local_key_mask)
        self.binding.past(cache, past, local_past)
        staged = s == 1 and self.stage_present
        if staged:
            stage = self.binding.staged_present(cache)
        else:
            scratch = self.binding.present_at(cache, write, s)
        logits = self.binding.logits_for(b, logits_index.shape[1])
        self.binding.run(self.session)
        if staged:  # by address: the cache's memory may be any host memory (numpy, OrtValues)
            local_slot = int(ring[1][0]) if ring else write
            for base, row, src, local in stage:
                ctypes.memmove(base + (local_slot if local else write) * row, src, row)
        elif scratch:  # the local layers' kept rows into their ring
            for name, rows in scratch.items():
                cache.write_local(name, ring[1], rows[ring[0]])
        return logits

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
        if self.fused is not None:
            return self._run_fused(cache, past, write, input_ids, position_ids, key_mask, logits_index, local_key_mask)
        if cache.local_ring is not None:
            return self._run(cache, past, write, input_ids, position_ids, key_mask, logits_index, local_key_mask,
                             cache.local_ring * cache.rings, ring)
        return self._run(cache, past, write, input_ids, position_ids, key_mask, logits_index, local_key_mask)

    # -- the fused graph (docs/fused.md, "The runtime"): the cache is head-major, one buffer per
    # tensor bound whole as both past and present; GroupQueryAttention reads the first
    # seqlens_k + 1 slots, adds attention_bias (the key mask as 0 / -inf) and writes the new
    # tokens at slot seqlens_k + 1 - S
    def _run_fused(self, cache: KVCache, past: int, write: int, input_ids: np.ndarray, position_ids: np.ndarray,
                   key_mask: np.ndarray | None, logits_index: np.ndarray,
                   local_key_mask: np.ndarray | None = None) -> np.ndarray:
        """past = slots [0, past) seen through key_mask [1, S, past + S] (None: all of them, the
        new block causally), the new tokens' K/V to slots [write, write + S). The op writes at
        the end of what it reads, so a call whose write slot is not `past` (a ring overwriting,
        a cell run elsewhere in a pool, or a first prompt whose positions do not run on: the op
        reads only position_ids[0] then) runs over the whole capacity with the rest masked,
        writes to the spare slots after it and is moved to its cells. local_key_mask [1, S, past + S]:
        the sliding-window layers' keys (a graph with them needs it), their bias built the same way."""
        s = input_ids.shape[1]
        if self.local_bias and local_key_mask is None:
            raise EdgeKVError(f"{self.name}: this graph has sliding-window layers and needs their {LOCAL_MASK}")
        runs_on = bool(np.all(np.diff(position_ids[0]) == 1))
        direct = write == past and (past > 0 or runs_on)
        at = past if direct else cache.capacity  # where the op writes
        if not direct and s > self.memory.spare:
            raise EdgeKVError(f"{self.name} (fused attention): a call of {s} tokens written inside the past "
                              f"exceeds the {self.memory.spare} spare slots (EDGEKV_ATTENTION=plain runs it)")
        feeds = {"input_ids": np.ascontiguousarray(input_ids, np.int64),
                 "position_ids": np.ascontiguousarray(position_ids, np.int64),
                 "logits_index": np.ascontiguousarray(logits_index, np.int64),
                 SEQLENS: np.array([at + s - 1], np.int32), TOTAL: np.array(at + s, np.int32),
                 BIAS: attention_bias(key_mask, past, at, s)}
        if self.local_bias:
            feeds[BIAS_LOCAL] = attention_bias(local_key_mask, past, at, s)
        if self.query_lengths:
            feeds[QUERY_LENGTHS] = np.array([s], np.int32)
        self.binding.feeds(feeds)
        self.binding.whole_cache(cache)
        logits = self.binding.logits_for(1, logits_index.shape[1])
        self.binding.run(self.session)
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
        if self.fused is None:
            raise BackendUnavailable(f"fused slots need the fused graph; {self.attention}")
        if not self.query_lengths:
            raise BackendUnavailable(f"fused slots need GroupQueryAttention's query_seqlens: onnxruntime "
                                     f">= {'.'.join(map(str, QUERY_LENGTHS_ORT))} (this is {self.ort.__version__})")
        return SlotMemory(slots)

    def run_slots(self, cache: KVCache, first: int, input_ids: np.ndarray, lengths: np.ndarray,
                  query_lengths: np.ndarray, logits_index: np.ndarray) -> np.ndarray:
        """One call over slots [first, first + B) of a slotted cache: entry b holds lengths[b]
        tokens and appends its first query_lengths[b] rows of input_ids [B, S] (right-padded; 0:
        idle, its slot unchanged) at its own positions lengths[b] + i. Each entry reads only its
        own slot, from cell 0, whatever else the call holds (batched = alone, docs/serve.md).
        Returns logits [B, K, V] of rows logits_index [B, K]."""
        if cache.layout != SlotMemory.layout:
            raise EdgeKVError(f"{self.name}: run_slots needs a slotted cache (memory=backend.slot_memory(k))")
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
        if self.local_bias:  # a slot's cell j holds position j: the window by position is by cell here
            feeds[BIAS_LOCAL] = slot_window_bias(feeds["position_ids"], slot_len, self.window)
        self.binding.feeds(feeds)
        self.binding.slot_block(cache, first, b)
        logits = self.binding.logits_for(b, logits_index.shape[1])
        self.binding.run(self.session)
        return logits

    def _zero_bias(self, s: int, total: int) -> np.ndarray:
        """attention_bias [1, 1, S, T] of zeros (a slot's entry sees its own cells, causally: the op's rule)."""
        if self._zero is None or self._zero.shape != (1, 1, s, total):
            self._zero = np.zeros((1, 1, s, total), np.float32)
        return self._zero
