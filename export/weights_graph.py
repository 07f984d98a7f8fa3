"""The ONNX pass that stores each quantized matrix as its QuantWeight says (export/weights.py:
what each matrix is stored as, the formats in its docstring): `quantize_initializers` replaces
each weight feeding a MatMul (or the embedding's Gather) with its integer codes (packed at their
width where they are narrower: edgekv/format/weight_forms.py) + DequantizeLinear, scales and
minimums as the file holds them, and the GGUF minimum's term."""
from __future__ import annotations

import hashlib

import numpy as np

from edgekv.format.weight_forms import pack_codes
from edgekv.graph.index import GraphIndex
from export.weights import Factors, QuantWeight


def _key(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest() + str(a.shape) + str(a.dtype)


def quantize_initializers(m, targets: dict[str, tuple[np.ndarray, QuantWeight]], embed: str):
    """m: the float graph. targets: name -> (the float weight [N, K] exactly as the torch model
    holds it, its QuantWeight). Every MatMul whose B is W^T (an initializer, or Transpose of one)
    and the Gather reading `embed`'s table are rewritten; unmatched targets are an error (a weight
    left in float would silently cost memory and speed)."""
    from onnx import numpy_helper

    index = GraphIndex(m)
    g, inits, producers = m.graph, index.inits, index.producer
    by_key = {}
    for name, (w, q) in targets.items():
        by_key[_key(w.T)] = name
        if name == embed:
            by_key["gather:" + _key(w)] = name
    arrays: dict[str, np.ndarray] = {}

    def array(tname):
        if tname not in arrays:
            arrays[tname] = numpy_helper.to_array(inits[tname])
        return arrays[tname]

    twin = table_twin(targets, embed)
    done, new_nodes, new_inits = set(), [], Emitted()
    for node in g.node:
        if node.op_type == "MatMul":
            b = node.input[1]
            val = None
            if b in inits:
                val = array(b)
            elif b in producers and producers[b].op_type == "Transpose" and producers[b].input[0] in inits:
                t = producers[b]
                perm = [a.ints for a in t.attribute if a.name == "perm"]
                if not perm or list(perm[0]) == [1, 0]:
                    val = array(t.input[0]).T
            name = by_key.get(_key(val)) if val is not None and val.ndim == 2 else None
            if name is not None:
                new_nodes.extend(_quantized_matmul(node, name, targets[name][1], val.dtype, new_inits))
                done.add(("matmul", name))
                continue
        if node.op_type == "Gather" and node.input[0] in inits and not any(a.name == "axis" and a.i for a in node.attribute):
            name = by_key.get("gather:" + _key(array(node.input[0])))
            if name is not None:
                dtype = array(node.input[0]).dtype
                new_nodes.extend(_shared_gather(node, twin, targets[name][1], dtype, new_inits) if twin
                                 else _quantized_gather(node, name, targets[name][1], dtype, new_inits))
                done.add(("gather", name))
                continue
        new_nodes.append(node)
    missing = [n for n in targets if ("matmul", n) not in done and ("gather", n) not in done]
    if missing:
        raise ValueError(f"quantized weights not found in the graph: {missing[:5]}")
    del g.node[:]
    g.node.extend(new_nodes)
    used = {i for n in g.node for i in n.input}
    kept = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(kept + new_inits)
    del g.value_info[:]
    g.value_info.extend(new_inits.value_info)
    return m


class Emitted(list):
    """The initializers a rewrite adds, and the value_info of the forms among them (a packed
    code tensor's type and shape: what the runtime's rewrites read without unpacking it)."""
    def __init__(self):
        super().__init__()
        self.value_info: list = []


def _codes(name: str, codes: np.ndarray, q: QuantWeight, inits: Emitted) -> list:
    """`codes` (q's, laid out as the graph reads them: axis 0 is K or N, which q.width found
    packable) as the initializer `name`, or at q.width's bits as a form named `name`
    (weight_forms.pack_codes). Returns the form's nodes."""
    bits, offset = q.width
    if bits >= q.bits:
        inits.append(_int_tensor(name, codes, q.bits))
        return []
    tensors, nodes, info = pack_codes(name, np.ascontiguousarray(codes), bits, offset)
    inits.extend(tensors)
    inits.value_info.append(info)
    return nodes


def _int_tensor(name: str, codes: np.ndarray, bits: int):
    from onnx import TensorProto, helper, numpy_helper

    if bits == 8:
        return numpy_helper.from_array(np.ascontiguousarray(codes.astype(np.int8)), name)
    flat = (codes.astype(np.int8).reshape(-1) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    packed = flat[0::2] | (flat[1::2] << 4)  # ONNX INT4: first element in the low nibble
    return helper.make_tensor(name, TensorProto.INT4, list(codes.shape), packed.tobytes(), raw=True)


HALF = "_f16"  # the fp16 initializer behind a scale or minimum tensor X: X_f16 -> Cast -> X


def _side(name: str, values: np.ndarray, dtype, half: bool, inits: list) -> list:
    """The scale or minimum tensor `name` in the graph's dtype: an initializer, or where the bundle
    keeps it as fp16 in a float32 graph (`half`: QuantWeight.half_scales) the fp16 initializer
    name + HALF and a Cast to float32 named `name`. Not the fp16 scale itself: DequantizeLinear's
    output type is its scale's (opset 21), so it would round every s*q to fp16; Cast to float32 it
    is exact (onnxruntime folds the Cast at load, TensorRT's staging too: edgekv/format/trt_graph.py).
    Returns the Cast (or no node)."""
    from onnx import TensorProto, helper, numpy_helper

    values = np.ascontiguousarray(values)
    if not half or np.dtype(dtype) != np.float32:
        inits.append(numpy_helper.from_array(values.astype(dtype), name))
        return []
    inits.append(numpy_helper.from_array(values.astype(np.float16), name + HALF))
    return [helper.make_node("Cast", [name + HALF], [name], to=TensorProto.FLOAT, name=name + "_widen")]


def _factored(name: str, f: Factors | None, k_first: bool, dtype, inits: Emitted) -> list | None:
    """The scales (or minimums) `name`, [K/B, N] (k_first) or [N, K/B, 1], as f.d·f.sc computed by
    four constant nodes (a weight form: edgekv/format/weight_forms.py) from the file's fp16 d and
    integer sc: its bytes, not float32 products (exact). A float16 graph gets the product Cast to
    float16: rounded once, as its float16 initializer was. None without factors."""
    from onnx import TensorProto, helper, numpy_helper

    if f is None:
        return None
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    n, supers = f.d.shape
    blocks = f.sc.shape[1]
    per = blocks // supers  # sub-blocks per super-block
    if k_first:
        d, sc, shape = f.d.T.reshape(supers, 1, n), f.sc.T.reshape(supers, per, n), [blocks, n]
    else:
        d, sc, shape = f.d.reshape(n, supers, 1), f.sc.reshape(n, supers, per), [n, blocks, 1]
    inits.value_info.append(helper.make_tensor_value_info(name, elem, shape))  # for what reads it unevaluated (check-trt)
    inits += [numpy_helper.from_array(np.ascontiguousarray(d).astype(np.float16), name + "_d"),
              numpy_helper.from_array(np.ascontiguousarray(sc).astype(np.int8), name + "_sc"),
              numpy_helper.from_array(np.array(shape, np.int64), name + "_shape")]
    mk = helper.make_node
    return [mk("Cast", [name + "_d"], [name + "_dw"], to=TensorProto.FLOAT, name=name + "_dw"),
            mk("Cast", [name + "_sc"], [name + "_scw"], to=TensorProto.FLOAT, name=name + "_scw"),
            mk("Mul", [name + "_scw", name + "_dw"], [name + "_prod"], name=name + "_prod")] + (
        [mk("Reshape", [name + "_prod", name + "_shape"], [name], name=name + "_factored")]
        if elem == TensorProto.FLOAT else
        [mk("Reshape", [name + "_prod", name + "_shape"], [name + "_f32"], name=name + "_factored"),
         mk("Cast", [name + "_f32"], [name], to=elem, name=name + "_narrow")])


def _quantized_matmul(node, name: str, q: QuantWeight, dtype, inits: list) -> list:
    """DQ(codes^T [K, N]) -> MatMul (+ the Q4_1 term)."""
    from onnx import helper, numpy_helper

    base = name.replace(".", "_")
    unpack = _codes(base + "_q", q.codes.T, q, inits)
    if q.block is None:
        inits.append(numpy_helper.from_array(q.scales.astype(dtype), base + "_scale"))
        dq = helper.make_node("DequantizeLinear", [base + "_q", base + "_scale"], [base + "_dq"], axis=1,
                              name=base + "_dq")
        nodes = unpack
    else:
        nodes = unpack + (_factored(base + "_scale", q.scale_factors, True, dtype, inits)
                          or _side(base + "_scale", q.scales.T, dtype, q.half_scales, inits))
        dq = helper.make_node("DequantizeLinear", [base + "_q", base + "_scale"], [base + "_dq"], axis=0,
                              block_size=q.block, name=base + "_dq")
    out = node.output[0]
    mm_out = out if q.mins is None else out + "_codes"
    nodes += [dq, helper.make_node("MatMul", [node.input[0], base + "_dq"], [mm_out], name=node.name or base + "_mm")]
    if q.mins is not None:
        nodes += _min_term(node.input[0], mm_out, out, base, q, dtype, inits)
    return nodes


def _min_term(x: str, mm_out: str, out: str, base: str, q: QuantWeight, dtype, inits: list) -> list:
    """out = mm_out + blocksum(x) @ (shift*s + m) [K/B, N]: the per-block sums of x [B, S, K] by a
    Reshape to [B, S, K/B, B] and a ReduceSum (measured ~2x cheaper per step than x @ a [K, K/B]
    matrix of ones; docs/weights.md). With a shift (INT4 codes of an unsigned type) s and m stay
    apart, [shift*blocksum(x), blocksum(x)] @ [s; m], s being the DequantizeLinear's own scale
    initializer: each stored exactly, no copy (onnxruntime folds the constant Concat at load)."""
    from onnx import helper, numpy_helper

    n, k = q.codes.shape
    nb = k // q.block
    inits.append(numpy_helper.from_array(np.array([0, 0, nb, q.block], np.int64), base + "_blocks"))
    inits.append(numpy_helper.from_array(np.array([-1], np.int64), base + "_last"))
    nodes = (_factored(base + "_min", q.min_factors, True, dtype, inits)
             or _side(base + "_min", q.mins.T, dtype, q.half_scales, inits))
    nodes += [helper.make_node("Reshape", [x, base + "_blocks"], [base + "_xblocks"], name=base + "_xblocks"),
             helper.make_node("ReduceSum", [base + "_xblocks", base + "_last"], [base + "_xsum"], keepdims=0,
                              name=base + "_xsum")]
    xs, mins = base + "_xsum", base + "_min"
    if q.shift:
        if q.bits != 4:  # tensorrt_graph rewrites an INT8 DQ's scale in place: it must not be shared
            raise ValueError("shifted codes are only for INT4 carriers")
        inits.append(numpy_helper.from_array(np.array(float(q.shift), dtype), base + "_shift"))
        nodes += [helper.make_node("Mul", [xs, base + "_shift"], [base + "_xsum_shift"], name=base + "_xsum_shift"),
                  helper.make_node("Concat", [base + "_xsum_shift", xs], [base + "_xsum2"], axis=-1,
                                   name=base + "_xsum2"),
                  helper.make_node("Concat", [base + "_scale", base + "_min"], [base + "_scale_min"], axis=0,
                                   name=base + "_scale_min")]
        xs, mins = base + "_xsum2", base + "_scale_min"
    return nodes + [helper.make_node("MatMul", [xs, mins], [base + "_xmin"], name=base + "_xmin"),
                    helper.make_node("Add", [mm_out, base + "_xmin"], [out], name=base + "_add_min")]


def table_twin(targets: dict[str, tuple[np.ndarray, QuantWeight]], embed: str) -> str | None:
    """The MatMul weight (a tied head) stored with exactly the embedding's codes, scales and
    minimums, whose initializers the table's Gather can then read: one copy of the table."""
    if embed not in targets:
        return None
    e = targets[embed][1]
    same = lambda a, b: a is b or (a is not None and b is not None and np.array_equal(a, b))  # noqa: E731
    for name, (_, q) in targets.items():
        if name != embed and q.bits == e.bits == 8 and q.block == e.block and not q.shift and same(q.codes, e.codes) \
                and same(q.scales, e.scales) and (q.mins is None) == (e.mins is None) and (q.mins is None or same(q.mins, e.mins)):
            return name
    return None


def _shared_gather(node, head: str, q: QuantWeight, dtype, inits: list) -> list:
    """The tied table's lookup on copies of the head's initializers, byte for byte (codes [K, V],
    scales and minimums [K/B, V], gathered along V): export/pipeline.py stores identical tensors
    once in the weights file (onnxruntime's MatMulNBits fusion needs the head's own initializers
    to feed nothing else, so the Gather cannot read those very tensors). The gathered codes go
    straight to a unit DequantizeLinear (TensorRT's rule; no Reshape after it), the scales are
    expanded to [K, B, S] instead, and one Transpose makes the rows [B, S, K]."""
    from onnx import helper, numpy_helper

    base = head.replace(".", "_") + "_table"  # its own initializers: the engine build's rewrite of the head leaves them
    ids, out = node.input[1], node.output[0]
    n, k = q.codes.shape
    b = q.block or k
    scales = q.scales.T if q.block else q.scales  # as the head's DequantizeLinear holds them (fp16 alike)
    widen = (_factored(base + "_scale", q.scale_factors, True, dtype, inits)  # (factors: block-wise K-quants only)
             or _side(base + "_scale", scales, dtype, q.half_scales, inits))
    if q.mins is not None:
        widen += (_factored(base + "_min", q.min_factors, True, dtype, inits)
                  or _side(base + "_min", q.mins.T, dtype, q.half_scales, inits))
    widen += _codes(base + "_q", q.codes.T, q, inits)
    inits += [numpy_helper.from_array(np.array(1.0, dtype), base + "_unit"),
              numpy_helper.from_array(np.array(0, np.int8), base + "_zero"),
              numpy_helper.from_array(np.array([-3], np.int64), base + "_axis"),
              numpy_helper.from_array(np.array([k // b, b, 1, 1], np.int64), base + "_blocks"),
              numpy_helper.from_array(np.array([k], np.int64), base + "_k")]
    # axis 1, not -1: onnxruntime's Gather is ~40x slower given the same axis as -1 (431 vs 10 us here)
    nodes = widen + [helper.make_node("Gather", [base + "_q", ids], [base + "_rows_q"], axis=1, name=base + "_gather_q"),
             helper.make_node("DequantizeLinear", [base + "_rows_q", base + "_unit", base + "_zero"], [base + "_rows"],
                              name=base + "_rows_dq"),
             helper.make_node("Shape", [ids], [base + "_ids_shape"], name=base + "_ids_shape"),
             helper.make_node("Concat", [base + "_k", base + "_ids_shape"], [base + "_kbs"], axis=0, name=base + "_kbs")]

    def per_element(src: str, tag: str) -> str:  # [K/B, V] (or [V] per channel) gathered -> [K, B, S]
        nodes.extend([
            helper.make_node("Gather", [src, ids], [f"{base}_{tag}_g"], axis=1 if q.block else 0, name=f"{base}_{tag}_g"),
            helper.make_node("Unsqueeze", [f"{base}_{tag}_g", base + "_axis"], [f"{base}_{tag}_u"], name=f"{base}_{tag}_u"),
            helper.make_node("Expand", [f"{base}_{tag}_u", base + "_blocks"], [f"{base}_{tag}_e"], name=f"{base}_{tag}_e"),
            helper.make_node("Reshape", [f"{base}_{tag}_e", base + "_kbs"], [f"{base}_{tag}_kbs"], name=f"{base}_{tag}_r")])
        return f"{base}_{tag}_kbs"

    rows = base + "_rows_scaled"
    nodes.append(helper.make_node("Mul", [base + "_rows", per_element(base + "_scale", "scale")], [rows], name=base + "_mul"))
    if q.mins is not None:
        nodes.append(helper.make_node("Add", [rows, per_element(base + "_min", "min")], [base + "_rows_min"], name=base + "_add"))
        rows = base + "_rows_min"
    nodes.append(helper.make_node("Transpose", [rows], [out], perm=[1, 2, 0], name=base + "_to_rows"))
    return nodes


def _quantized_gather(node, name: str, q: QuantWeight, dtype, inits: list) -> list:
    """Gather the INT8 rows, DequantizeLinear with a unit scale (exact), times the rows' scales."""
    from onnx import helper, numpy_helper

    base = name.replace(".", "_")
    ids, out = node.input[1], node.output[0]
    n, k = q.codes.shape
    nb = 1 if q.block is None else k // q.block
    # a block-wise table is stored [V, K/B, B] so that the gathered rows meet their scales without
    # a Reshape between DequantizeLinear and Mul (onnxruntime's Q/DQ propagation mishandles that)
    unpack = _codes(base + "_q", q.codes.reshape(n, nb, k // nb) if q.block else q.codes, q, inits)
    inits.append(numpy_helper.from_array(np.array(1.0, dtype), base + "_unit"))
    inits.append(numpy_helper.from_array(np.array(0, np.int8), base + "_zero"))
    nodes = unpack + (_factored(base + "_scale", q.scale_factors, False, dtype, inits)
                      or _side(base + "_scale", q.scales.reshape(n, nb, 1) if q.block else q.scales.reshape(n, 1), dtype,
                               q.half_scales, inits))
    if q.shift:
        raise ValueError("the embedding's codes are 8-bit, never shifted")
    scaled = out if q.block is None else base + "_rows_bs"
    nodes += [helper.make_node("Gather", [base + "_q", ids], [base + "_rows_q"], axis=0, name=base + "_gather_q"),
             helper.make_node("DequantizeLinear", [base + "_rows_q", base + "_unit", base + "_zero"], [base + "_rows"],
                              name=base + "_rows_dq"),
             helper.make_node("Gather", [base + "_scale", ids], [base + "_rows_scale"], axis=0, name=base + "_gather_s"),
             helper.make_node("Mul", [base + "_rows", base + "_rows_scale"],
                              [scaled if q.mins is None else base + "_rows_bs_nomin"], name=base + "_scale_rows")]
    if q.mins is not None:  # a type with a minimum (Q4_K, Q5_1, ...): + the rows' block minimums
        nodes += (_factored(base + "_min", q.min_factors, False, dtype, inits)
                  or _side(base + "_min", q.mins.reshape(n, nb, 1), dtype, q.half_scales, inits))
        nodes += [helper.make_node("Gather", [base + "_min", ids], [base + "_rows_min"], axis=0, name=base + "_gather_m"),
                  helper.make_node("Add", [base + "_rows_bs_nomin", base + "_rows_min"], [scaled], name=base + "_min_rows")]
    if q.block is not None:
        inits.append(numpy_helper.from_array(np.array([0, 0, k], np.int64), base + "_rows_shape"))
        nodes.append(helper.make_node("Reshape", [scaled, base + "_rows_shape"], [out], name=base + "_from_blocks"))
    return nodes


def needs_opset_21(plan: dict[str, QuantWeight], embed: str) -> bool:
    """INT4 and DequantizeLinear's block_size exist from opset 21 (docs/graph.md): any block-wise
    matrix needs it (the embedding's blocks are only gathered: a unit-scale DQ and a Mul)."""
    return any(q.bits == 4 or (q.block is not None and name != embed) for name, q in plan.items())
