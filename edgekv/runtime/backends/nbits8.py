"""8-bit block weights as onnxruntime's MatMulNBits where onnxruntime does not fuse them itself
(docs/weights.md, "onnxruntime runs it fused"; issue 40 item 3a: the Jetson's stock Pythons).

A bundle's quantized weight product is `DequantizeLinear(codes, scale[, zero point], axis=0,
block_size=b) -> MatMul`. onnxruntime rewrites the 4-bit form into its MatMulNBits kernel since
1.19, the 8-bit form only since 1.25 (measured: 1.20.1, 1.22.1, 1.23.2 and 1.24.4 leave it as
written, 1.25.0 fuses it). Left as written, every call dequantizes the whole matrix to float32 and
runs a float MatMul in float activations (other greedy tokens than accuracy level 4's int8 ones).
The default bundle's 8-bit head (576 x 49152) under onnxruntime 1.23.2 (the newest wheel for
CPython 3.10 on aarch64, JetPack 6's Python), 2 threads, a loaded 2-core x86 VM: as written 12
tok/s decode, peak RSS 500 MiB; rewritten here 25-27 tok/s, 440 MiB (1.32: 24-26 tok/s, 355 MiB).

The MatMulNBits kernel itself takes 8 bits earlier (1.22 at accuracy level 4, 1.23 at level 0 too;
probed at load here, not assumed): `fuse_8bit` writes the node onnxruntime 1.25+ would make. On
1.23.2 a 576 x 1024 product so written equals 1.32's own fusion of the DequantizeLinear -> MatMul
bit for bit (x86 AVX-512); tests/test_ort_versions.py checks the rewrite against the installed
onnxruntime's own fusion where it has one. Where the kernel does not run, the graph is left as
written and the report's line says so.

The rewritten weights (codes transposed to MatMulNBits' [N, blocks, block] uint8 layout, float32
scales, uint8 zero points) are handed to the session by reference, as forms.py hands its
unpacked codes."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from edgekv.graph.forms import HANDED, Handed, handed_tensor
from edgekv.graph.index import GraphIndex
from edgekv.graph.passes.fused_match import MS
from edgekv.runtime.backends.versions import dotted, ort_version

# the first onnxruntime whose graph optimizer rewrites an 8-bit block DequantizeLinear -> MatMul
# into MatMulNBits itself (measured: 1.24.4 does not, 1.25.0 does)
NBITS8_FUSION_ORT = (1, 25)


def fuses_8bit(version: str) -> bool:
    """onnxruntime `version` fuses 8-bit block weights into MatMulNBits by itself."""
    return ort_version(version) >= NBITS8_FUSION_ORT


@dataclass
class Nbits8Report:
    """What became of the graph's 8-bit block weight products on this onnxruntime."""
    version: str
    found: int = 0            # 8-bit block DequantizeLinear -> MatMul products in the graph
    rewritten: int = 0        # of them, written as MatMulNBits here
    kernel: bool | None = None  # the 8-bit MatMulNBits kernel ran in the load's probe (None: not probed)
    accuracy: int = 4
    names: list = field(default_factory=list, repr=False)  # the products left as written

    @property
    def changed(self) -> bool:
        return self.rewritten > 0

    @property
    def fused_by_ort(self) -> bool:
        return fuses_8bit(self.version)

    def line(self) -> str | None:
        """The load log's line where 8-bit weights run as written (slower, other activations)."""
        left = self.found - self.rewritten
        if self.fused_by_ort or left <= 0:
            return None
        why = (f"and its 8-bit MatMulNBits kernel does not run at accuracy level {self.accuracy} here"
               if self.kernel is False else "and they were not rewritten at load")
        return (f"weights: onnxruntime {self.version} fuses 8-bit block weights into MatMulNBits only from "
                f"{dotted(NBITS8_FUSION_ORT)} {why}: {left} matri{'x runs' if left == 1 else 'ces run'} "
                "as DequantizeLinear -> MatMul (float32, dequantized on every call: slower, more memory, "
                "float activations)")


def _attrs(node) -> dict:
    from onnx import helper
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def eight_bit_products(g) -> list[tuple]:
    """(MatMul, its DequantizeLinear) for every MatMul by a block-wise 8-bit DequantizeLinear along
    axis 0 of 2-D codes (an initializer, a handed placeholder, or a weight form's value_info)."""
    from onnx import TensorProto as T

    ix = GraphIndex(g)
    inits, infos, producer = ix.inits, ix.infos, ix.producer
    found = []
    for n in g.node:
        if n.op_type != "MatMul" or n.domain not in ("", "ai.onnx") or len(n.input) != 2:
            continue
        dq = producer.get(n.input[1])
        if dq is None or dq.op_type != "DequantizeLinear":
            continue
        a = _attrs(dq)
        if not a.get("block_size") or a.get("axis", 1) != 0:
            continue
        c = dq.input[0]
        if c in inits:
            ty, dims = inits[c].data_type, list(inits[c].dims)
        elif c in infos:
            tt = infos[c].type.tensor_type
            ty, dims = tt.elem_type, [d.dim_value for d in tt.shape.dim]
        else:
            continue
        if ty in (T.INT8, T.UINT8) and len(dims) == 2:
            found.append((n, dq))
    return found


def _probe_model(accuracy: int, k: int = 64, n: int = 16, block: int = 32):
    from onnx import TensorProto as T, helper as h, numpy_helper as nh

    rng = np.random.default_rng(0)
    b = rng.integers(0, 256, (n, k // block, block)).astype(np.uint8)
    s = (rng.random((n, k // block)) * 0.02 + 1e-3).astype(np.float32)
    node = h.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain=MS, K=k, N=n, bits=8,
                       block_size=block, accuracy_level=accuracy)
    g = h.make_graph([node], "probe8", [h.make_tensor_value_info("x", T.FLOAT, ["M", k])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["M", n])], [nh.from_array(b, "b"), nh.from_array(s, "s")])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 21), h.make_opsetid(MS, 1)], ir_version=10)
    w = ((b.astype(np.float32) - 128) * s[:, :, None]).reshape(n, k).T  # the default zero point: 128
    return model, w


@lru_cache(maxsize=None)
def _kernel_runs(ort, accuracy: int) -> bool:
    model, w = _probe_model(accuracy)
    try:
        opts = ort.SessionOptions()
        opts.log_severity_level = 4
        s = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(1).standard_normal((3, w.shape[0])).astype(np.float32)
        y = s.run(None, {"x": x})[0]
    except Exception:  # an onnxruntime without the kernel raises at load or at run (its own types)
        return False
    want = x @ w
    return bool(np.abs(y - want).max() <= 0.05 * np.abs(want).max())  # level 4: int8 activations


def kernel_runs(ort, accuracy: int) -> bool:
    """onnxruntime `ort`'s CPU MatMulNBits runs 8-bit weights at `accuracy` (a one-node probe, once)."""
    return _kernel_runs(ort, int(accuracy))


def _matmulnbits(codes: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, block: int):
    """MatMulNBits' B [N, blocks, block] uint8, scales [N, blocks] float32 and zero points
    [N, blocks] uint8 (None: the kernel's default 128) for DequantizeLinear's codes [K, N], scale
    [blocks, N] and zero point [blocks, N] along axis 0: the same dequantized values."""
    k, n = codes.shape
    blocks = -(-k // block)
    if codes.dtype == np.int8:  # (c - z) == ((c + 128) - (z + 128)): the uint8 kernel's codes
        u = (codes.astype(np.int16) + 128).astype(np.uint8)
        z = None if zp is None else (zp.astype(np.int16) + 128).astype(np.uint8)
    else:
        u = codes.astype(np.uint8, copy=False)
        z = np.zeros((blocks, n), np.uint8) if zp is None else zp.astype(np.uint8)
    b = np.zeros((n, blocks * block), np.uint8)  # the last block padded (K is the node's attribute)
    b[:, :k] = u.T
    return (b.reshape(n, blocks, block), np.ascontiguousarray(scale.astype(np.float32).T),
            None if z is None else np.ascontiguousarray(z.T))


def fuse_8bit(graph: bytes, base_dir: str, handed: Handed, ort, accuracy: int,
              device: str = "cpu") -> tuple[bytes, Handed, Nbits8Report]:
    """The serialized graph with every 8-bit block weight product written as MatMulNBits, where
    onnxruntime `ort` does not fuse them itself (< 1.25) and its kernel runs them (probed), on the
    CPU; else as given. `handed`: forms.py's arrays for the graph's placeholders (codes or scales
    read from there); returned with the placeholders no longer read dropped and the new weights added."""
    report = Nbits8Report(ort.__version__, accuracy=int(accuracy))
    if device != "cpu" or report.fused_by_ort or b"block_size" not in graph:
        return graph, handed, report
    index = GraphIndex.from_bytes(graph, base_dir)
    index.handed = dict(handed.buffers)
    report = Nbits8(ort, accuracy, device).apply(index)
    if not report.rewritten:
        return graph, handed, report
    return index.serialize(), Handed([(nm, a) for nm, a in index.handed.items() if nm in index.inits]), report


class Nbits8:
    """The pass (nbits8): the graph's 8-bit block weight products as MatMulNBits (fuse_8bit), the
    new weights into index.handed; its report (`report`): the load log's line where they stay."""
    name = "nbits8"

    def __init__(self, ort, accuracy: int, device: str = "cpu"):
        self.ort, self.accuracy, self.device = ort, int(accuracy), device
        self.report = Nbits8Report(ort.__version__, accuracy=self.accuracy)

    def apply(self, index: GraphIndex) -> Nbits8Report:
        import onnx
        from onnx import helper, numpy_helper

        report = self.report
        if self.device != "cpu" or report.fused_by_ort:
            return report
        model, g = index.model, index.g
        found = eight_bit_products(g)
        report.found = len(found)
        if not found:
            return report
        report.kernel = kernel_runs(self.ort, self.accuracy)
        if not report.kernel:
            report.names = [n.name for n, _ in found]
            return report
        inits, producer, given, base_dir = index.inits, index.producer, index.handed, index.base_dir

        def value(name: str) -> np.ndarray | None:
            if name in given:
                return given[name]
            t = inits.get(name)
            if t is not None:
                if t.data_location == onnx.TensorProto.EXTERNAL and any(e.key == "location" and e.value == HANDED
                                                                          for e in t.external_data):
                    return None
                return numpy_helper.to_array(t, base_dir)
            n = producer.get(name)
            if n is not None and n.op_type == "Cast" and (x := value(n.input[0])) is not None:
                return x.astype(helper.tensor_dtype_to_np_dtype(_attrs(n)["to"]))
            return None

        for mm, dq in found:
            codes = value(dq.input[0])
            scale = value(dq.input[1])
            zp = value(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
            block = _attrs(dq)["block_size"]
            if (codes is None or scale is None or (len(dq.input) > 2 and dq.input[2] and zp is None)
                    or codes.ndim != 2 or scale.shape != (-(-codes.shape[0] // block), codes.shape[1])
                    or block < 16 or block & (block - 1)):
                report.names.append(mm.name)
                continue
            b, s, z = _matmulnbits(codes, scale, zp, block)
            base = f"{dq.input[0]}/nbits8"
            ins = [mm.input[0], f"{base}/b", f"{base}/scales"] + ([f"{base}/zero_points"] if z is not None else [])
            arrays = [(f"{base}/b", b), (f"{base}/scales", s)] + ([(f"{base}/zero_points", z)] if z is not None else [])
            node = helper.make_node("MatMulNBits", ins, list(mm.output), name=mm.name or base, domain=MS,
                                    K=codes.shape[0], N=codes.shape[1], bits=8, block_size=block,
                                    accuracy_level=self.accuracy)
            mm.CopyFrom(node)
            g.initializer.extend(handed_tensor(nm, a) for nm, a in arrays)
            given.update(arrays)
            report.rewritten += 1
        if not report.rewritten:
            return report
        _drop_unread(g)
        if not any(o.domain == MS for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS, 1))
        index.reindex()  # (the handed placeholders no longer read: not initializers any more)
        return report


def _drop_unread(g) -> None:
    """Remove the nodes and initializers nothing reads any more (the replaced DequantizeLinear,
    its scale's Cast, their tensors), repeatedly."""
    outputs = {o.name for o in g.output}
    while True:
        read = {i for n in g.node for i in n.input} | outputs
        dead = [n for n in g.node if n.output and not any(o in read for o in n.output)
                and n.op_type in ("DequantizeLinear", "Cast")]
        for n in dead:
            g.node.remove(n)
        if not dead:
            break
    read = {i for n in g.node for i in n.input} | outputs
    unread = [t for t in g.initializer if t.name not in read]
    for t in unread:
        g.initializer.remove(t)
    names = {t.name for t in unread}
    keep = [v for v in g.value_info if v.name not in names]
    del g.value_info[:]
    g.value_info.extend(keep)
