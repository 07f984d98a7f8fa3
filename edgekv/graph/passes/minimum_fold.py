"""minimum-fold: a GGUF minimum folded into onnxruntime's MatMulNBits zero points at load
(docs/weights.md, "The minimum in the kernel").

The bundle carries a Q4_1/Q4_K (or Q5_1/Q5_K) matrix as W = s*(c + shift) + m per block of B along
K: a block-wise DequantizeLinear of the codes c -> MatMul, plus a "minimum term"
blocksum(x) @ (shift*s + m) (export/weights_graph.py, _quantized_matmul / _min_term). onnxruntime fuses
the first part into MatMulNBits, whose int8-activation kernel (accuracy level 4) then rounds x for
the codes while the minimum term sees the exact x: the rounding of x is weighted by W - (shift*s + m)
instead of W, which is most of the int4 bundle's extra error against llama.cpp (whose Q4_1 x Q8_1 dot
applies the minimum to the rounded x's block sums).

MatMulNBits applies its zero points to the rounded x's block sums (MLAS precomputes -s*zp per block
and adds sum(x_q)*that). Its zero points must be integers for that path: float zero points make
onnxruntime skip prepacking and dequantize the whole matrix on every call (matmul_nbits.cc:
has_unquantized_zero_point_ -> ComputeBUnpacked; measured ~30x slower). So, per block,

    W = s*c + m''             m'' = m + s*shift
      = s*(c - zp) + r        zp = clip(round(-m''/s)) in the codes' signed range, r = m'' + s*zp

The DequantizeLinear gets zp as its zero point (an INT4/INT8 initializer like the codes), which
onnxruntime's own DQ -> MatMul fusion carries into MatMulNBits' uint8 zero points; only the remainder
r (|r| <= |s|/2 where the block spans 0; r = m where s == 0) stays a MatMul blocksum(x) @ r, half the
rows of the old [shift*blocksum, blocksum] @ [s; m]. Its blocksum is one MatMul of x by a 0/1
[K, K/B] constant shared by every matrix of that K (one per input x), where the bundle writes a
Reshape + ReduceSum per matrix: three nodes a matrix instead of four (measured 1.03-1.08x faster
decode steps, docs/weights.md). Every value is exact: zp is an integer, s*zp
has at most 23 significant bits, and r is checked to be exactly m'' + s*zp in float32 (a matrix where
it is not keeps its old term). The codes stay the bundle's own initializer (onnxruntime packs them as
before); the derived zero points ([K/B, N] at the codes' width) and r are small and built at load.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgekv.graph.forms import Handed, handed_tensor
from edgekv.graph.index import GraphIndex, prune_unneeded

# the remainders are handed to onnxruntime as OrtValues over our own arrays (forms.Handed)


@dataclass
class MinTerm:
    """One matrix's DQ -> MatMul + minimum term, as found in the graph."""
    dq: object      # DequantizeLinear(codes [K, N], scale [K/B, N]), block-wise along K
    mm: object      # MatMul(x, dq)
    term: object    # MatMul(blocksum(x) or [shift*blocksum(x), blocksum(x)], m or [s; m])
    add: object     # mm + term: W x
    xs: str         # blocksum(x) [.., K/B]
    mins: str       # float32 [K/B, N]
    shift: float    # the codes are c and the weight s*(c + shift) + m


@dataclass
class FoldReport:
    folded: int = 0          # matrices now one MatMulNBits with zero points
    exact_zero: int = 0      # ... of which need no remainder term
    kept: dict = field(default_factory=dict)  # codes initializer -> why its old term stays
    # the remainders (name, array): handed to the session by reference, not copied into the graph
    # (measured: a copy in the serialized graph cost more resident memory than the old term)
    buffers: list = field(default_factory=list, repr=False)

    def hand_to(self, ort, opts) -> list:
        """Give the session options the remainders; returns the OrtValues, to be kept as long as the session."""
        return Handed(self.buffers).hand_to(ort, opts)

    @property
    def changed(self) -> bool:
        return self.folded > 0

    def line(self) -> str:
        kept = f"; {len(self.kept)} kept as written ({next(iter(self.kept.values()))})" if self.kept else ""
        return (f"minimums: {self.folded} matrices as MatMulNBits zero points "
                f"({self.folded - self.exact_zero} with a remainder term){kept}")


def _scalar(g: GraphIndex, name: str) -> float | None:
    v = g.const(name)
    return float(v) if v is not None and v.size == 1 else None


def _only_reader(g: GraphIndex, name: str, node) -> bool:
    return g.only_reader(name, node)


def _blocksum(g: GraphIndex, xs: str, x: str, block: int) -> bool:
    """xs = ReduceSum(Reshape(x, [0, 0, K/B, B]), [-1], keepdims=0)."""
    rs = g.op(xs, "ReduceSum")
    sh = rs and g.op(rs.input[0], "Reshape")
    if sh is None or sh.input[0] != x or g.attr(rs, "keepdims", 1) != 0:
        return False
    axes, dims = g.const(rs.input[1]) if len(rs.input) > 1 else None, g.const(sh.input[1])
    return axes is not None and list(axes.reshape(-1)) == [-1] and dims is not None and int(dims.reshape(-1)[-1]) == block


def _match(g: GraphIndex, add) -> MinTerm | None:
    """add = MatMul(x, DQ(codes, scale)) + minimum term (either written form), else None."""
    for a, b in (add.input, add.input[::-1]):
        mm, mt = g.op(a, "MatMul"), g.op(b, "MatMul")
        dq = mm and g.op(mm.input[1], "DequantizeLinear")
        if dq is None or mt is None or g.tensor(dq.input[0]) is None or (len(dq.input) > 2 and dq.input[2]):
            continue
        block, x = g.attr(dq, "block_size", 0), mm.input[0]
        if not block or g.attr(dq, "axis", 1) != 0 or not g.is_const(dq.input[1]):
            continue
        if not (_only_reader(g, dq.output[0], mm) and _only_reader(g, mm.output[0], add)
                and _only_reader(g, mt.output[0], add)):
            continue
        if g.is_const(mt.input[1]):  # blocksum(x) @ m
            xs, mins, shift = mt.input[0], mt.input[1], 0.0
        else:  # [shift * blocksum(x), blocksum(x)] @ [s; m]
            cx, cw = g.op(mt.input[0], "Concat"), g.op(mt.input[1], "Concat")
            mul = cx and g.op(cx.input[0], "Mul")
            if cw is None or mul is None or len(cx.input) != 2 or len(cw.input) != 2 or cw.input[0] != dq.input[1] \
                    or not g.is_const(cw.input[1]) or g.attr(cw, "axis") != 0 or g.attr(cx, "axis") != -1:
                continue
            xs, mins = cx.input[1], cw.input[1]
            shift = next((_scalar(g, i) for i in mul.input if i != xs), None)
            if xs not in mul.input or shift is None:
                continue
            if not (_only_reader(g, cx.output[0], mt) and _only_reader(g, cw.output[0], mt)):
                continue
        if not _blocksum(g, xs, x, block):
            continue
        return MinTerm(dq, mm, mt, add, xs, mins, shift)
    return None


def find_min_terms(g: GraphIndex) -> list[MinTerm]:
    return [t for n in list(g.g.node) if n.op_type == "Add" and (t := _match(g, n)) is not None]


def fold_weights(s: np.ndarray, m: np.ndarray, shift: float, bits: int):
    """s and m [K/B, N] float32 of signed `bits`-bit codes c with W = s*(c + shift) + m per block:
    (zp [K/B, N] integer zero points in the codes' signed range, r [K/B, N] float32) with
    W = s*(c - zp) + r exactly, or None where r is not a float32."""
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    s64 = s.astype(np.float64)
    m64 = m.astype(np.float64) + s64 * shift  # W = s*c + m'' (s*shift: at most 23 bits, exact)
    with np.errstate(divide="ignore", invalid="ignore"):
        zp = np.where(s64 != 0, np.clip(np.rint(-m64 / s64), lo, hi), 0.0)
    r = m64 + s64 * zp  # exact in float64 (two terms of at most 24 significant bits)
    r32 = r.astype(np.float32)
    if not np.array_equal(r32.astype(np.float64), r):
        return None
    return zp.astype(np.int8), r32


def blocksum_matrix(k: int, block: int) -> np.ndarray:
    """E [K, K/B] float32 with x @ E = blocksum(x): 1 where row k lies in block j (k // B == j), else 0
    (each value of x times 1 in its own block's column, exact zeros elsewhere)."""
    e = np.zeros((k, k // block), np.float32)
    e[np.arange(k), np.arange(k) // block] = 1.0
    return e


class _Blocksums:
    """blocksum(x) as one MatMul(x, E) per input x, E one initializer per (K, B): matrices reading
    the same x share its MatMul, matrices of the same K its constant. The MatMuls go into the
    graph at once (place), each right after x's producer: one pass over the nodes, not one a MatMul."""

    def __init__(self, model, helper, numpy_helper):
        self.model, self.helper, self.nh = model, helper, numpy_helper
        self.outputs: dict[str, str] = {}  # x -> its blocksum
        self.constants: set[str] = set()
        self.pending: dict = {}  # x -> its MatMul (in the order made), until place()

    def of(self, x: str, k: int, block: int) -> str:
        if x in self.outputs:
            return self.outputs[x]
        e = f"edgekv/blocksum_{k}x{block}"
        if e not in self.constants:
            self.model.graph.initializer.append(self.nh.from_array(blocksum_matrix(k, block), e))
            self.constants.add(e)
        out = f"{x}/blocksum{block}"
        self.pending[x] = self.helper.make_node("MatMul", [x, e], [out], name=out)
        self.outputs[x] = out
        return out

    def place(self) -> None:
        """Every pending MatMul right after x's producer (a graph input's: first), the newest
        first where several follow one node, as inserting each on its own would: still sorted."""
        nodes = self.model.graph.node
        after = {o: i + 1 for i, n in enumerate(nodes) for o in n.output if o in self.pending}
        # the highest positions first (no insert shifts one still to come); at one position the
        # oldest first, so that each newer one lands before it
        for at, _, x in sorted(((after.get(x, 0), k, x) for k, x in enumerate(self.pending)), key=lambda t: (-t[0], t[1])):
            nodes.insert(at, self.pending[x])
        self.pending.clear()


def _int_initializer(helper, TP, name: str, values: np.ndarray, bits: int):
    """An INT4 (packed, the first in the low nibble) or INT8 initializer, as the codes are stored."""
    if bits == 8:
        return helper.make_tensor(name, TP.INT8, list(values.shape), values.astype(np.int8).tobytes(), raw=True)
    flat = (values.astype(np.int8).reshape(-1) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return helper.make_tensor(name, TP.INT4, list(values.shape), (flat[0::2] | (flat[1::2] << 4)).tobytes(), raw=True)


def fold_minimums(model, base_dir: str) -> FoldReport:
    """Rewrite `model` (an onnx ModelProto, in place): every DQ -> MatMul + minimum term gets the
    minimum's integer part as the DequantizeLinear's zero point (onnxruntime fuses it into
    MatMulNBits' zero points) and keeps only the remainder's MatMul (on x's blocksum by one shared
    MatMul, _Blocksums), or none where r is all 0."""
    return fold(GraphIndex(model, base_dir))


def fold(g: GraphIndex) -> FoldReport:
    """fold_minimums over an index (its maps as they are; the caller reindexes after a fold)."""
    model = g.model
    report = FoldReport()
    if not any(n.op_type == "DequantizeLinear" and g.attr(n, "block_size", 0) for n in g.g.node):
        return report  # no block-wise DequantizeLinear, nothing to fold
    TP, helper = g.onnx.TensorProto, g.onnx.helper
    sums = _Blocksums(model, helper, g.nh)
    for t in find_min_terms(g):
        codes = t.dq.input[0]
        codes_type, codes_dims = g.tensor(codes)  # an initializer, or packed codes (their value_info)
        bits = {TP.INT4: 4, TP.INT8: 8}.get(codes_type)
        if bits is None:
            report.kept[codes] = "codes neither INT4 nor INT8"
            continue
        folded = fold_weights(g.const(t.dq.input[1]), g.const(t.mins), t.shift, bits)  # the codes are not read
        if folded is None:
            report.kept[codes] = "a remainder m + s*z that is not a float32"
            continue
        zp, r = folded
        base = codes + "/fold"
        model.graph.initializer.append(_int_initializer(helper, TP, base + "_zp", zp, bits))
        t.dq.input.append(base + "_zp")
        if r.any():  # the remainder on blocksum(x): |r| <= |s|/2 where a block spans 0
            model.graph.initializer.append(handed_tensor(base + "_r", r))
            report.buffers.append((base + "_r", r))
            k, block = codes_dims[0], g.attr(t.dq, "block_size")  # codes [K, N]
            t.term.input[0], t.term.input[1] = sums.of(t.mm.input[0], k, block), base + "_r"
        else:  # the zero points carry all of it: W x is the MatMul's output
            t.mm.output[0] = t.add.output[0]
            model.graph.node.remove(t.add)
            model.graph.node.remove(t.term)
            report.exact_zero += 1
        report.folded += 1
    sums.place()
    if report.folded:
        prune_unneeded(model.graph)  # the bundle's Reshape + ReduceSum blocksums, unread initializers
    return report


class MinimumFold:
    """The pass: its report (FoldReport, `report`) and the remainders into index.handed."""
    name = "minimum-fold"

    def __init__(self):
        self.report = FoldReport()

    def apply(self, index: GraphIndex) -> FoldReport:
        self.report = fold(index)
        index.handed.update(self.report.buffers)
        return self.report
