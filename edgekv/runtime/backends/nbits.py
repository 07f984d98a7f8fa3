"""A GGUF minimum folded into onnxruntime's MatMulNBits at load (docs/weights.md, "The minimum in
the kernel").

The bundle carries a Q4_1/Q4_K (or Q5_1/Q5_K) matrix as W = s*(c + shift) + m per block of B along
K: a block-wise DequantizeLinear of the codes c -> MatMul, plus a "minimum term"
blocksum(x) @ (shift*s + m) (export/weights.py, _quantized_matmul / _min_term). onnxruntime fuses
the first part into MatMulNBits, whose int8-activation kernel (accuracy level 4) then rounds x for
the codes while the minimum term sees the exact x: the rounding of x is weighted by W - (shift*s + m)
instead of W, which is most of the int4 bundle's extra error against llama.cpp (whose Q4_1 x Q8_1 dot
applies the minimum to the rounded x's block sums).

MatMulNBits applies its zero points to the rounded x's block sums (MLAS precomputes -s*zp per block
and adds sum(x_q)*that). Its zero points must be integers for that path: float zero points make
onnxruntime skip prepacking and dequantize the whole matrix on every call (matmul_nbits.cc:
has_unquantized_zero_point_ -> ComputeBUnpacked; measured ~30x slower). So, per block,

    W = s*u + m'              u = c + o unsigned codes (o = 8 for 4 bits), m' = m + s*(shift - o)
      = s*(u - z) + r         z = clip(round(-m'/s), 0, 2**bits - 1), r = m' + s*z

MatMulNBits(x; u, s, z) carries all of the minimum but the remainder r (|r| <= |s|/2 where the
block spans 0; r = m where s == 0), which stays a MatMul blocksum(x) @ r, half the rows of the old
[shift*blocksum, blocksum] @ [s; m]. Every value is exact: z is an integer, s*z has at most 23
significant bits, and r is checked to be exactly m' + s*z in float32 (a matrix where it is not keeps
its old term). A matrix whose r is all zero needs no term at all.

The derived tensors (packed unsigned codes [N, K/B, B*bits/8], scales [N, K/B], zero points, r) are
built from the bundle's own initializers into the graph handed to onnxruntime; nothing is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgekv.runtime.backends.fused import MS, _Graph


@dataclass
class MinTerm:
    """One matrix's DQ -> MatMul + minimum term, as found in the graph."""
    x: str          # the activation [.., K]
    xs: str         # blocksum(x) [.., K/B] (the term's ReduceSum output)
    out: str        # the Add's output: W x
    codes: str      # INT4/INT8 initializer [K, N]
    scale: str      # float32 [K/B, N], the DequantizeLinear's
    mins: str       # float32 [K/B, N]
    shift: float    # the codes are c and the weight s*(c + shift) + m
    block: int
    gone: list = field(default_factory=list)  # the nodes the fold replaces


@dataclass
class FoldReport:
    folded: int = 0          # matrices now one MatMulNBits with zero points
    exact_zero: int = 0      # ... of which need no remainder term
    kept: dict = field(default_factory=dict)  # codes initializer -> why its old term stays

    def line(self) -> str:
        kept = f"; {len(self.kept)} kept as written ({next(iter(self.kept.values()))})" if self.kept else ""
        return (f"minimums: {self.folded} matrices as MatMulNBits zero points "
                f"({self.folded - self.exact_zero} with a remainder term){kept}")


def _scalar(g: _Graph, name: str) -> float | None:
    v = g.const(name)
    return float(v) if v is not None and v.size == 1 else None


def _only_reader(g: _Graph, name: str, node) -> bool:
    readers = g.consumers.get(name, [])
    return len(readers) == 1 and readers[0] is node and name not in {o.name for o in g.g.output}


def _blocksum(g: _Graph, xs: str, x: str, block: int) -> bool:
    """xs = ReduceSum(Reshape(x, [0, 0, K/B, B]), [-1], keepdims=0)."""
    rs = g.op(xs, "ReduceSum")
    sh = rs and g.op(rs.input[0], "Reshape")
    if sh is None or sh.input[0] != x or g.attr(rs, "keepdims", 1) != 0:
        return False
    axes, dims = g.const(rs.input[1]) if len(rs.input) > 1 else None, g.const(sh.input[1])
    return axes is not None and list(axes.reshape(-1)) == [-1] and dims is not None and int(dims.reshape(-1)[-1]) == block


def _match(g: _Graph, add) -> MinTerm | None:
    """add = MatMul(x, DQ(codes, scale)) + minimum term (either written form), else None."""
    for a, b in (add.input, add.input[::-1]):
        mm, mt = g.op(a, "MatMul"), g.op(b, "MatMul")
        dq = mm and g.op(mm.input[1], "DequantizeLinear")
        if dq is None or mt is None or dq.input[0] not in g.inits or (len(dq.input) > 2 and dq.input[2]):
            continue
        block, x = g.attr(dq, "block_size", 0), mm.input[0]
        if not block or g.attr(dq, "axis", 1) != 0 or dq.input[1] not in g.inits:
            continue
        if not (_only_reader(g, dq.output[0], mm) and _only_reader(g, mm.output[0], add)
                and _only_reader(g, mt.output[0], add)):
            continue
        gone = [dq, mm, mt, add]
        if mt.input[1] in g.inits:  # blocksum(x) @ m
            xs, mins, shift = mt.input[0], mt.input[1], 0.0
        else:  # [shift * blocksum(x), blocksum(x)] @ [s; m]
            cx, cw = g.op(mt.input[0], "Concat"), g.op(mt.input[1], "Concat")
            mul = cx and g.op(cx.input[0], "Mul")
            if cw is None or mul is None or len(cx.input) != 2 or len(cw.input) != 2 or cw.input[0] != dq.input[1] \
                    or cw.input[1] not in g.inits or g.attr(cw, "axis") != 0 or g.attr(cx, "axis") != -1:
                continue
            xs, mins = cx.input[1], cw.input[1]
            shift = next((_scalar(g, i) for i in mul.input if i != xs), None)
            if xs not in mul.input or shift is None:
                continue
            if not (_only_reader(g, cx.output[0], mt) and _only_reader(g, cw.output[0], mt)
                    and _only_reader(g, mul.output[0], cx)):
                continue
            gone += [cx, cw, mul]
        if not _blocksum(g, xs, x, block):
            continue
        return MinTerm(x, xs, add.output[0], dq.input[0], dq.input[1], mins, shift, block, gone)
    return None


def find_min_terms(g: _Graph) -> list[MinTerm]:
    return [t for n in list(g.g.node) if n.op_type == "Add" and (t := _match(g, n)) is not None]


def fold_weights(codes: np.ndarray, s: np.ndarray, m: np.ndarray, shift: float, bits: int):
    """codes [K, N] (signed INT4, or INT8), s and m [K/B, N] float32, W = s*(codes + shift) + m per
    block: (u [N, K] unsigned codes, z [N, K/B] integer zero points, r [K/B, N] float32 remainder)
    with W = s*(u - z) + r exactly, or None where r is not a float32."""
    top = 2 ** bits - 1
    o = 8 if bits == 4 else (0 if codes.min() >= 0 else 128)  # unsigned codes: 4-bit c in -8..7 -> 0..15
    u = (codes.astype(np.int16) + o).astype(np.uint8).T
    s64, m64 = s.astype(np.float64), m.astype(np.float64) + s.astype(np.float64) * (shift - o)  # W = s*u + m'
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(s64 != 0, np.clip(np.rint(-m64 / s64), 0, top), 0.0)
    r = m64 + s64 * z  # each term exact in float64 (s: <= 19 bits, z: <= 8)
    r32 = r.astype(np.float32)
    if not np.array_equal(r32.astype(np.float64), r):
        return None
    return u, z.T.astype(np.uint8), r32


def _pack(u: np.ndarray, bits: int, block: int) -> np.ndarray:
    """[N, K] unsigned codes -> MatMulNBits' B [N, K/B, B*bits/8] (4 bits: the first in the low nibble)."""
    n, k = u.shape
    u = u.reshape(n, k // block, block)
    return np.ascontiguousarray(u if bits == 8 else u[..., 0::2] | (u[..., 1::2] << 4))


def _pack_zero_points(z: np.ndarray, bits: int) -> np.ndarray:
    """[N, K/B] -> [N, ceil(K/B * bits / 8)] uint8 (4 bits: two blocks a byte, the first low)."""
    if bits == 8:
        return np.ascontiguousarray(z)
    if z.shape[1] % 2:
        z = np.concatenate([z, np.zeros((z.shape[0], 1), np.uint8)], axis=1)
    return np.ascontiguousarray(z[:, 0::2] | (z[:, 1::2] << 4))


def fold_minimums(model, base_dir: str, accuracy: int) -> FoldReport:
    """Rewrite `model` (an onnx ModelProto, in place) so that every DQ -> MatMul + minimum term is one
    com.microsoft MatMulNBits with the minimum as integer zero points (+ the remainder's MatMul)."""
    g = _Graph(model, base_dir)
    report = FoldReport()
    TP, nh, helper = g.onnx.TensorProto, g.nh, g.onnx.helper
    new_nodes: dict[int, list] = {}  # id(the Add) -> what replaces it
    drop: set[int] = set()
    for t in find_min_terms(g):
        init = g.inits[t.codes]
        bits = {TP.INT4: 4, TP.INT8: 8}.get(init.data_type)
        k, n = (int(d) for d in init.dims)
        if bits is None or k % t.block:
            report.kept[t.codes] = "codes neither INT4 nor INT8 in whole blocks"
            continue
        folded = fold_weights(g.const(t.codes), g.const(t.scale), g.const(t.mins), t.shift, bits)
        if folded is None:
            report.kept[t.codes] = "a remainder m + s*z that is not a float32"
            continue
        u, z, r = folded
        base = t.codes + "/nbits"
        s = np.ascontiguousarray(g.const(t.scale).astype(np.float32).T)  # [N, K/B]
        model.graph.initializer.extend([nh.from_array(_pack(u, bits, t.block), base + "_B"),
                                        nh.from_array(s, base + "_scales"),
                                        nh.from_array(_pack_zero_points(z, bits), base + "_zp")])
        exact = not r.any()
        y = t.out if exact else base + "_y"
        nodes = [helper.make_node("MatMulNBits", [t.x, base + "_B", base + "_scales", base + "_zp"], [y],
                                  name=base, domain=MS, K=k, N=n, bits=bits, block_size=t.block,
                                  accuracy_level=accuracy)]
        if not exact:  # the remainder on blocksum(x): |r| <= |s|/2 where a block spans 0
            model.graph.initializer.append(nh.from_array(r, base + "_r"))
            nodes += [helper.make_node("MatMul", [t.xs, base + "_r"], [base + "_rx"], name=base + "_rx"),
                      helper.make_node("Add", [y, base + "_rx"], [t.out], name=base + "_add")]
        new_nodes[id(t.gone[3])] = nodes
        drop.update(id(x) for x in t.gone)
        report.folded += 1
        report.exact_zero += exact
    if report.folded:
        nodes = [m for x in model.graph.node for m in (new_nodes.get(id(x)) or ([] if id(x) in drop else [x]))]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        _prune_dead(model)
        if not any(o.domain == MS for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS, 1))
    return report


def _prune_dead(model) -> None:
    """Drop nodes no graph output needs (a blocksum with no reader left) and unread initializers."""
    need = {o.name for o in model.graph.output}
    keep = []
    for n in reversed(list(model.graph.node)):
        if any(o in need for o in n.output):
            keep.append(n)
            need.update(i for i in n.input if i)
    del model.graph.node[:]
    model.graph.node.extend(reversed(keep))
    inits = [t for t in model.graph.initializer if t.name in need]
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)


def fold_graph(graph: bytes, base_dir: str, accuracy: int) -> tuple[bytes, FoldReport]:
    """The serialized graph with its minimums folded (as given when there is none)."""
    import onnx

    model = onnx.load_from_string(graph)
    report = fold_minimums(model, base_dir, accuracy)
    return (model.SerializeToString() if report.folded else graph), report
