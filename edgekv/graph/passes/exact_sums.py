"""exact-sums: row-independent attention (`exact`, ort-cpu's default; docs/weights.md, "Temperature 0").

Row-independent attention (`exact`, the default; docs/weights.md, "Temperature 0"). onnxruntime's
Softmax sums a row in vector lanes fixed by each element's place in memory, and its MatMul sums
the cells in blocks of 256: where a sequence's cells lie in the pool, how long the bound past is
and which row of the call it is all change the rounding of its attention by an ulp, and the int8
rounding that follows (the cache's codes, the fused kernel's activations) turns that ulp into a
different greedy token. Summed in fixed point instead, every term a multiple of one power of two
and every partial sum exactly representable, the sums are the same in any order and layout.
EDGEKV_EXACT=0 runs the graph as written (faster prefill, batch-dependent greedy text)."""
from __future__ import annotations

import numpy as np

from edgekv.graph.passes import Changed

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

    def __init__(self, index, max_cells: int):
        self.index, self.onnx, self.model, self.g = index, index.onnx, index.model, index.g
        self.T = index.onnx.TensorProto
        terms = (2 * max(1, max_cells) - 1).bit_length()  # log2 of a row's terms: past cells + new tokens
        self.exp_bits = 52 - terms
        # int32 sums of 127 * 128 * terms; beyond 2**17 terms a row the bytes could overflow
        self.fits = terms <= 31 - 2 * LIMB_BITS
        self.prod, self.uses, self.inputs = index.producer, index.consumers, index.inputs
        self._ranks: dict[str, int] | None = None
        self.applied = self.fits and self._rewrite()

    # -- reading the graph: constants held in the graph (an initializer or a Constant node)
    def _scalar(self, name: str):
        return self.index.scalar(name, external=False, forms=False)

    def _ints(self, name: str):
        return self.index.ints(name, external=False, forms=False)

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
        if name not in self.index.inits:
            self.index.add_initializer(self.onnx.numpy_helper.from_array(np.asarray(value, dtype), name))
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
        self.g.node.extend(nodes)  # (the index is rebuilt by run_passes)
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


class ExactSums:
    """The pass: every attention of the graph rewritten, or the graph left as written (a float or
    int4 cache, or an opset below 18: ReduceMax takes its axes as an input from 18)."""
    name = "exact-sums"

    def __init__(self, max_cells: int):
        self.max_cells = max_cells

    def apply(self, index) -> Changed:
        if max((o.version for o in index.model.opset_import if o.domain in ("", "ai.onnx")), default=0) < 18:
            return Changed(False)
        return Changed(ExactAttention(index, self.max_cells).applied)
