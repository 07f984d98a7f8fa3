"""Weight products whose rows do not depend on the call's row count, on every CPU (a graph pass;
docs/weights.md, "Temperature 0 on every CPU").

Batched = alone needs each token's row of a weight product to come out the same whatever else is
in the call. onnxruntime's kernels give no such promise, and on some CPUs they break it: on an
AVX2-only x86 the 4-bit MatMulNBits at accuracy level 4 has a separate single-row kernel
(MLAS sqnbitgemm_m1_sym_kernel_avx2_int8_blklen32.h) whose float sum over blocks rounds otherwise
than the many-row kernel, so a lone decode step (one row) and the same token decoded beside
others (many rows) differ by an ulp, and within a few layers by a token. AVX-512 VNNI runs one
kernel for both; the Jetson's ARM cores run others again (KleidiAI).

So nothing here assumes a kernel's behaviour: at load, `probe` runs each kind of weight product
the graph holds (bits, block, zero points; float) on this CPU with the session's own threads and
accuracy level, at row counts 1..17 and offsets, and finds which of three cases holds:

- every row the same at any row count: nothing to do;
- the single-row call differs but every call of two or more rows agrees: `pad_single_rows`
  rewrites those products to run on M + 1 rows (the input's last row repeated, the extra output
  row dropped), so no call is ever single-row; a decode step costs one extra row of a product that
  is bound by reading its weights;
- rows differ between calls of several rows: no rewrite makes them exact, and the backend says
  batched = alone does not hold here (`RowPlan.exact` False, the load log's line)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from edgekv.graph.index import GraphIndex
from edgekv.graph.passes import Changed

# the row counts and offsets the probe compares: tiles of 1, 2, 4, 8 and 16 rows and their remainders
PROBE_ROWS = (2, 3, 4, 5, 7, 8, 9, 16, 17)
PROBE_OFFSETS = (0, 3)
PROBE_N = 16  # output columns of a probe: rows are what is compared (a few column tiles)
FLOAT = "f32"


@dataclass(frozen=True)
class Kind:
    """One kind of weight product, as onnxruntime's kernel choice sees it."""
    bits: int | str    # 4, 8 (block-wise DequantizeLinear -> MatMulNBits) or FLOAT (a constant float matrix)
    block: int         # block size along K (0 for float)
    zero_points: bool  # the DequantizeLinear has zero points
    k: int             # the product's K (kernels choose by it too)

    def __str__(self) -> str:
        if self.bits == FLOAT:
            return f"float32 MatMul (K={self.k})"
        return f"{self.bits}-bit MatMulNBits (block {self.block}{', zero points' if self.zero_points else ''}, K={self.k})"


@dataclass
class RowPlan:
    """What the probe found for a graph's weight products on this CPU."""
    padded: set = field(default_factory=set)    # kinds whose single-row calls run on two rows
    unequal: set = field(default_factory=set)   # kinds whose rows differ between many-row calls

    @property
    def exact(self) -> bool:
        return not self.unequal

    def line(self) -> str | None:
        """The load log's line, where something differs from the kernels as they are."""
        if self.unequal:
            return ("weight rows: onnxruntime's " + ", ".join(sorted(map(str, self.unequal)))
                    + " gives a row other bits by the call's row count on this CPU: batched = alone does not hold here")
        if self.padded:
            return ("weight rows: onnxruntime's single-row " + ", ".join(sorted(map(str, self.padded)))
                    + " rounds otherwise than its many-row kernel on this CPU: single-row calls run on two rows")
        return None


def _kind_of(node, inits: dict, producer: dict) -> tuple[Kind, int] | None:
    """(the kind, N) of a MatMul by a constant weight, else None."""
    from onnx import TensorProto as T

    if node.op_type == "MatMulNBits":  # written by nbits8.py where onnxruntime < 1.25 does not fuse 8 bits
        a = {x.name: x.i for x in node.attribute}
        return Kind(a["bits"], a["block_size"], len(node.input) > 3 and bool(node.input[3]), a["K"]), a["N"]
    w = node.input[1]
    dq = producer.get(w)
    if dq is not None and dq.op_type == "DequantizeLinear":
        attrs = {a.name: a.i for a in dq.attribute}
        codes = inits.get(dq.input[0])
        if not attrs.get("block_size") or attrs.get("axis", 1) != 0 or codes is None or len(codes.dims) != 2:
            return None
        bits = {T.INT4: 4, T.UINT4: 4, T.INT8: 8, T.UINT8: 8}.get(codes.data_type)
        if bits is None:
            return None
        zp = len(dq.input) > 2 and bool(dq.input[2])
        return Kind(bits, attrs["block_size"], zp, int(codes.dims[0])), int(codes.dims[1])
    t = inits.get(w)
    if t is not None and t.data_type == T.FLOAT and len(t.dims) == 2:
        return Kind(FLOAT, 0, False, int(t.dims[0])), int(t.dims[1])
    return None


def weight_products(model) -> list[tuple]:
    """Every MatMul of the graph by a constant weight: (node, its Kind, its N)."""
    ix = GraphIndex(model)
    inits, producer = ix.inits, ix.producer
    return [(n, *kn) for n in ix.g.node
            if n.op_type in ("MatMul", "MatMulNBits") and (kn := _kind_of(n, inits, producer)) is not None]


def _probe_model(kind: Kind):
    from onnx import TensorProto as T, helper as h, numpy_helper as nh

    rng = np.random.default_rng(0)
    x = h.make_tensor_value_info("x", T.FLOAT, ["M", kind.k])
    y = h.make_tensor_value_info("y", T.FLOAT, ["M", PROBE_N])
    if kind.bits == FLOAT:
        w = nh.from_array(rng.standard_normal((kind.k, PROBE_N)).astype(np.float32), "w")
        g = h.make_graph([h.make_node("MatMul", ["x", "w"], ["y"])], "probe", [x], [y], [w])
        return h.make_model(g, opset_imports=[h.make_opsetid("", 21)], ir_version=10)  # 10: onnxruntime >= 1.20 reads it
    lo, hi = (-8, 8) if kind.bits == 4 else (-128, 128)
    ty = T.INT4 if kind.bits == 4 else T.INT8
    blocks = -(-kind.k // kind.block)
    inits = [h.make_tensor("c", ty, [kind.k, PROBE_N], rng.integers(lo, hi, (kind.k, PROBE_N)).ravel().tolist()),
             nh.from_array((rng.random((blocks, PROBE_N)) * 0.02 + 1e-3).astype(np.float32), "s")]
    ins = ["c", "s"]
    if kind.zero_points:
        inits.append(h.make_tensor("z", ty, [blocks, PROBE_N], rng.integers(-3, 3, (blocks, PROBE_N)).ravel().tolist()))
        ins.append("z")
    g = h.make_graph([h.make_node("DequantizeLinear", ins, ["d"], axis=0, block_size=kind.block),
                      h.make_node("MatMul", ["x", "d"], ["y"])], "probe", [x], [y], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 21)], ir_version=10)


def rows_differ(run, k: int) -> tuple[bool, bool]:
    """(single-row calls differ from many-row ones, many-row calls differ among themselves) for
    `run`, x [M, k] -> y [M, N], compared bit for bit against one call of every probe row."""
    x = np.random.default_rng(1).standard_normal((max(PROBE_ROWS) + max(PROBE_OFFSETS), k)).astype(np.float32)
    whole = run(x)
    many = any(not np.array_equal(run(x[o:o + m]), whole[o:o + m]) for m in PROBE_ROWS for o in PROBE_OFFSETS)
    single = any(not np.array_equal(run(x[i:i + 1]), whole[i:i + 1]) for i in range(len(x)))
    return single, many


@lru_cache(maxsize=None)
def probe(kind: Kind, threads: int, accuracy: int) -> tuple[bool, bool]:
    """rows_differ for `kind` on this CPU, run by onnxruntime as a session of the backend's runs it
    (through the same 8-bit pass as the bundle: the kernel it will run)."""
    import onnxruntime as ort

    from edgekv.graph.forms import Handed
    from edgekv.runtime.backends.nbits8 import fuse_8bit

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy))
    graph, handed, _ = fuse_8bit(_probe_model(kind).SerializeToString(), ".", Handed(), ort, accuracy)
    kept = handed.hand_to(ort, opts)  # noqa: F841  the session reads these arrays while it lives
    s = ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
    return rows_differ(lambda x: s.run(None, {"x": x})[0], kind.k)


def plan_rows(model, threads: int, accuracy: int, prober=probe) -> RowPlan:
    """Which of the graph's weight products need their single-row calls padded (or cannot be made exact)."""
    plan = RowPlan()
    for kind in {k for _, k, _ in weight_products(model)}:
        single, many = prober(kind, threads, accuracy)
        if many:
            plan.unequal.add(kind)
        elif single:
            plan.padded.add(kind)
    return plan


def pad_single_rows(model, kinds: set) -> int:
    """Rewrite (in place) each MatMul of a kind in `kinds` to run on its input's rows plus a copy of
    the last one: x [.., K] -> [M + 1, K] -> MatMul -> the first M rows -> [.., N]. Returns how
    many products were rewritten (the graph keeps its topological order)."""
    from onnx import helper as h, numpy_helper as nh

    g = model.graph
    chosen = {n.output[0]: (kind, nn) for n, kind, nn in weight_products(model) if kind in kinds}  # by output: protobuf wrappers are not stable objects
    if not chosen:
        return 0
    consts = [("rows.pad", [0, 0, 1, 0]), ("rows.zero", [0]), ("rows.minus1", [-1])]
    padded: dict[str, str] = {}  # a flattened, padded input shared by the products that read it
    nodes = []
    for n in g.node:
        if n.op_type not in ("MatMul", "MatMulNBits") or n.output[0] not in chosen:
            nodes.append(n)
            continue
        (kind, nn), x, out = chosen[n.output[0]], n.input[0], n.output[0]
        if x not in padded:
            q = padded[x] = f"rows.{x}."
            consts.append((q + "k", [-1, kind.k]))
            nodes += [h.make_node("Reshape", [x, q + "k"], [q + "flat"], name=q + "flat"),
                      h.make_node("Pad", [q + "flat", "rows.pad"], [q + "padded"], name=q + "pad", mode="edge"),
                      h.make_node("Shape", [x], [q + "lead"], name=q + "lead", end=-1)]
        q, p = padded[x], f"rows.{out}."
        consts.append((p + "n", [nn]))
        n.input[0], n.output[0] = q + "padded", p + "all"
        nodes += [n, h.make_node("Slice", [p + "all", "rows.zero", "rows.minus1", "rows.zero"], [p + "rows"],
                                 name=p + "rows"),
                  h.make_node("Concat", [q + "lead", p + "n"], [p + "shape"], name=p + "shape", axis=0),
                  h.make_node("Reshape", [p + "rows", p + "shape"], [out], name=p + "unflat")]
    rebuilt = [type(nodes[0])() for _ in nodes]
    for dst, src in zip(rebuilt, nodes):
        dst.CopyFrom(src)
    del g.node[:]
    g.node.extend(rebuilt)
    g.initializer.extend(nh.from_array(np.array(v, np.int64), name) for name, v in consts)
    return len(chosen)


class RowPadding:
    """The pass (row-padding): the plan for this CPU (`plan`), single-row calls padded where it says."""
    name = "row-padding"

    def __init__(self, threads: int, accuracy: int):
        self.threads, self.accuracy = threads, accuracy
        self.plan = RowPlan()

    def apply(self, index: GraphIndex) -> Changed:
        self.plan = plan_rows(index.model, self.threads, self.accuracy)
        if not self.plan.padded:
            return Changed(False)
        return Changed(True, pad_single_rows(index.model, self.plan.padded))
