"""Weights stored smaller than the tensor a node reads (edgekv/format/weight_forms.py): packed 5-
and 6-bit codes and a K-quant's factored scales. Oracles: the codes and scales themselves, read
back through onnxruntime (its constant folding at load, and its kernels with folding off), onnx's
reference evaluator, and the TensorRT staging's fold; the packed bytes against the bits."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edgekv.format.weight_forms import code_width, pack_codes, packable
from edgekv.graph.passes.trt_staging import fold_forms
from export.gguf_blocks import DECODERS
from export.weights import from_gguf_blocks
from export.weights_graph import Emitted, _factored
from tests.test_gguf_kquants import random_blocks

RANGES = [(-16, 15, 5, 16), (0, 31, 5, 0), (-32, 31, 6, 32), (0, 63, 6, 0), (-8, 7, 5, 16), (-127, 127, 8, 0)]


def _model(nodes, inits, out, elem, shape):
    g = helper.make_graph(nodes + [helper.make_node("Identity", [out], ["y"])], "forms", [],
                          [helper.make_tensor_value_info("y", elem, list(shape))], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def _ort(model, optimize: bool) -> np.ndarray:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, {})[0]


def _folded(model, name) -> np.ndarray:
    from onnx import numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    assert fold_forms(m, ".") == [name]
    assert [n.op_type for n in m.graph.node] == ["Identity"]  # every form node gone, its inputs too
    assert [i.name for i in m.graph.initializer] == [name]
    return numpy_helper.to_array(m.graph.initializer[0])


@pytest.mark.parametrize("lo,hi,bits,offset", RANGES)
@pytest.mark.parametrize("shape", [(64, 24), (32, 3, 8)])
def test_packed_codes_read_back_exactly(lo, hi, bits, offset, shape):
    """Random codes over the whole range (both ends present): the width chosen is the fewest bits,
    and the packed form gives back every code through onnxruntime (folded at load, and op by op),
    the reference evaluator and the staging's fold; it costs bits/8 bytes a code."""
    rng = np.random.default_rng(bits + offset + len(shape))
    codes = rng.integers(lo, hi + 1, shape).astype(np.int8)
    codes.flat[0], codes.flat[1] = lo, hi
    assert code_width(codes) == (bits, offset)
    if bits == 8:
        return
    assert packable(shape, bits)
    inits, nodes, info = pack_codes("w_q", codes, bits, offset)
    assert info.name == "w_q" and info.type.tensor_type.elem_type == TensorProto.INT8
    assert [d.dim_value for d in info.type.tensor_type.shape.dim] == list(shape)
    model = _model(nodes, inits, "w_q", TensorProto.INT8, shape)
    onnx.checker.check_model(model, full_check=True)
    for got in (_ort(model, True), _ort(model, False), _folded(model, "w_q")):
        assert got.dtype == np.int8
        np.testing.assert_array_equal(got, codes)
    packed = sum(len(t.raw_data) for t in inits if t.name in ("w_q_lo", "w_q_hi"))
    assert packed == codes.size * bits // 8


def test_rows_that_do_not_fill_a_byte_are_not_packed():
    assert not packable((36, 8), 5) and packable((40, 8), 5) and not packable((34, 8), 6) and packable((36, 8), 6)
    assert not packable((40,), 5) and not packable((40, 8), 8)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k_first", [True, False])
def test_factored_scales_are_the_decoded_products(kind, k_first):
    """A K-quant's scales (and minimums) as the file's d times its integer sc, four constant nodes:
    onnxruntime computes exactly the float32 products the decoder made (both layouts the graph
    uses: [K/B, N] for a MatMul, [N, K/B, 1] for the table's Gather)."""
    rng = np.random.default_rng(7)
    n, k = 6, 512
    q = from_gguf_blocks(kind, random_blocks(kind, n, k, rng, spread=3), (n, k))
    sides = [(q.scales, q.scale_factors)] + ([(q.mins, q.min_factors)] if q.mins is not None else [])
    for values, f in sides:
        inits = Emitted()
        nodes = _factored("s", f, k_first, np.float32, inits)
        want = values.T if k_first else values.reshape(n, -1, 1)
        model = _model(nodes, inits, "s", TensorProto.FLOAT, want.shape)
        for got in (_ort(model, True), _ort(model, False), _folded(model, "s")):
            np.testing.assert_array_equal(got, want)
        assert sum(len(t.raw_data) for t in inits if t.name in ("s_d", "s_sc")) == f.nbytes == 2 * n * k // 256 + n * k // q.block
    inits = Emitted()  # a float16 graph: the exact product rounded once to float16, as its initializer was
    model = _model(_factored("s", q.scale_factors, True, np.float16, inits), inits, "s", TensorProto.FLOAT16, (k // q.block, n))
    for got in (_ort(model, True), _ort(model, False), _folded(model, "s")):
        np.testing.assert_array_equal(got, q.scales.T.astype(np.float16))


def test_every_kept_type_costs_at_most_its_files_bytes_plus_the_k_quants_sub_scales():
    """Per 256 weights: each type's stored bytes (codes at their width, fp16 fields as fp16, a
    K-quant's sub-block scales and minimums one byte each) against the file's block bytes."""
    rng = np.random.default_rng(8)
    extra = {"Q4_K": 4, "Q5_K": 4}  # 16 six-bit scale/min pairs in 12 bytes in the file, 16 bytes here
    for kind, (_, per, nbytes) in DECODERS.items():
        q = from_gguf_blocks(kind, random_blocks(kind, 8, 256, rng), (8, 256))
        if q.bits == 8:  # what an 8-bit carrier keeps: Q5_*, Q6_K at their width; Q8_0 as it is
            from export.weights import to_eight_bit
            q = to_eight_bit(q)
        assert q.nbytes == 8 * (nbytes * 256 // per + extra.get(kind, 0)), kind
