"""The runtime on an older onnxruntime (issue 40 item 3a: JetPack 6's CPython 3.10 on aarch64 gets
onnxruntime 1.23.2 at most). pyproject's floor is what the graph as written needs; what a later
release adds is chosen at load by version, each with the load log's line where it is left out:

- the fused graph (GroupQueryAttention over an int8 cache on CPU): 1.27 (fused.py, MIN_ORT);
- its query_seqlens (serve's fused slots): 1.32 (ort.py, QUERY_LENGTHS_ORT);
- onnxruntime's own fusion of 8-bit block weights into MatMulNBits: 1.25 (nbits8.py), before
  which nbits8.fuse_8bit writes the node itself where the 8-bit kernel runs (probed).

The gates are checked with onnxruntime as installed but reporting another version (`Ort`), so they
run on any release; what needs a real kernel is skipped where the installed release lacks it."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto as T, helper as h, numpy_helper as nh  # noqa: E402

from edgekv.errors import BackendUnavailable  # noqa: E402
from edgekv.format.bundle import load_bundle  # noqa: E402
from edgekv.runtime.assemble import open_runtime, ort_version_lines  # noqa: E402
from edgekv.runtime.backends import ort as ort_mod  # noqa: E402
from edgekv.graph.forms import Handed, handed_tensor  # noqa: E402
from edgekv.runtime.backends.fused import (ATTENTION_ENV, MIN_ORT, QUERY_LENGTHS, QUERY_LENGTHS_ORT,  # noqa: E402
                                           choose_attention, ort_refusal, ort_version_ok)
from edgekv.runtime.backends.nbits8 import (NBITS8_FUSION_ORT, Nbits8Report,  # noqa: E402
                                            eight_bit_products, fuse_8bit, fuses_8bit, kernel_runs)
from edgekv.runtime.backends.versions import ORT_FLOOR, ORT_LOADS, ort_version, too_old  # noqa: E402
from edgekv.runtime.cache import KVCache  # noqa: E402
from tests.stream_reference import new_sequence, reference, run_stream

ROOT = Path(__file__).resolve().parent.parent
REAL = ort_mod._import_ort()
REAL_VERSION = ort_version(REAL.__version__)
# the release JetPack 6's Python gets (the newest onnxruntime wheel for cp310 aarch64)
JETPACK6_ORT = "1.23.2"


class Ort:
    """onnxruntime as installed, but for the version it reports."""

    def __init__(self, version: str, session=None):
        self.__version__ = version
        if session is not None:
            self.InferenceSession = session

    def __getattr__(self, name):
        return getattr(REAL, name)


def as_version(monkeypatch, version: str) -> None:
    monkeypatch.setattr(ort_mod, "_import_ort", lambda: Ort(version))


# --- pyproject: the floor installs where JetPack 6's Python can -----------------------------------

def pyproject_floor() -> tuple[int, int]:
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(r"onnxruntime\b", d))
    floor = re.search(r">=\s*([0-9.]+)", spec)
    assert floor, f"{spec!r}: no lower bound"
    return ort_version(floor.group(1))


def test_pyprojects_floor_installs_on_jetpack6_and_the_installed_release_meets_it():
    floor = pyproject_floor()
    assert floor == ORT_FLOOR  # versions.py says why
    assert floor <= ort_version(JETPACK6_ORT), f"onnxruntime>={floor} cannot install on CPython 3.10 aarch64"
    assert ORT_LOADS <= floor < NBITS8_FUSION_ORT < MIN_ORT < QUERY_LENGTHS_ORT  # later ones: gated at load
    assert REAL_VERSION >= floor


@pytest.mark.parametrize("version,ok", [("1.16.3", False), ("1.20.1", False), ("1.21.0", True),
                                        (JETPACK6_ORT, True), ("1.32.0", True)])
def test_below_1_21_no_bundle_runs_and_that_is_one_line(version, ok):
    why = too_old(version)
    assert (why is None) is ok
    if not ok:
        assert why.startswith(f"onnxruntime {version} cannot run a bundle") and ">= 1.22" in why


def test_the_backend_refuses_an_onnxruntime_below_1_21(tiny_bundle_int8, monkeypatch):
    """An onnxruntime-gpu from NVIDIA's index is not held to pyproject's floor: the backend says
    which release it needs instead of failing to find the weights ("corrupt bundle")."""
    if "too_old" not in vars(ort_mod):
        pytest.skip("ort.py does not check versions.too_old yet (issue 40 item 3a's patch)")
    as_version(monkeypatch, "1.20.1")
    with pytest.raises(BackendUnavailable, match=r"onnxruntime 1\.20\.1 cannot run a bundle.*>= 1\.22"):
        ort_mod.OrtBackend(load_bundle(tiny_bundle_int8), threads=1)


# --- the fused graph: 1.27 ---------------------------------------------------------------------

@pytest.mark.parametrize("version,ok", [("1.23.2", False), ("1.26.1", False), ("1.27.0", True),
                                        ("1.32.0", True), ("1.33.0.dev20261201", True), ("2.0.0", True)])
def test_the_fused_gate(version, ok):
    assert ort_version_ok(version) is ok
    why = ort_refusal(version)
    if ok:
        assert why is None
    else:
        assert why == f"onnxruntime {version} has no int8-cache GroupQueryAttention on CPU (the fused path needs 1.27+)"


def stub_backend(version: str):
    """What choose_attention reads of a backend: ort-cpu's, onnxruntime reporting `version`."""
    return SimpleNamespace(name="ort-cpu", fuses=True, fused_refusal=lambda bundle, mode: None, ort=Ort(version))


def test_choose_attention_keeps_the_graph_as_written_below_1_27(tiny_bundle_int8_static):
    """The decision itself: a static int8 cache that auto fuses on 1.27 runs as written on 1.26
    and older, the line naming the release found and the one needed; `fused` asked is one line."""
    b = load_bundle(tiny_bundle_int8_static)
    for version in (JETPACK6_ORT, "1.26.1"):
        fused, line = choose_attention(stub_backend(version), b, "auto")
        assert fused is None
        assert line.startswith("attention: the bundle's graph as written (") and version in line and "1.27" in line
        with pytest.raises(BackendUnavailable, match=r"1\.27"):
            choose_attention(stub_backend(version), b, "fused")
    fused, line = choose_attention(stub_backend("1.27.0"), b, "auto")
    assert fused is not None and line.startswith("attention: fused")


@pytest.mark.parametrize("version", [JETPACK6_ORT, "1.26.1"])
def test_open_runtime_says_which_attention_and_why_in_one_line(tiny_bundle_int8_static, version, monkeypatch):
    """The graph as written runs (a real session, greedy steps) and the load log has exactly one
    attention line, naming both releases."""
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    as_version(monkeypatch, version)
    lines = []
    with open_runtime(tiny_bundle_int8_static, backend="ort-cpu", threads=1, log=lines.append) as rt:
        assert rt.backend.fused is None and "key_mask" in {i.name for i in rt.backend.session.get_inputs()}
        g = reference(rt)
        x = g.prefill(list(range(5, 20)))
        for _ in range(4):
            x = g.decode_step(int(np.argmax(x)))
        assert np.isfinite(x).all()
    said = [ln for ln in lines if ln.startswith("attention:")]
    assert len(said) == 1, lines
    assert version in said[0] and "1.27" in said[0] and "graph as written" in said[0]


def test_no_attention_line_where_the_version_is_not_the_reason(tiny_bundle_int8, tiny_bundle_int8_static, monkeypatch):
    """Per-token scales never fuse (no line about the release); EDGEKV_ATTENTION=plain is the user's choice."""
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    as_version(monkeypatch, JETPACK6_ORT)
    lines = []
    open_runtime(tiny_bundle_int8, backend="ort-cpu", threads=1, log=lines.append).close()
    monkeypatch.setenv(ATTENTION_ENV, "plain")
    open_runtime(tiny_bundle_int8_static, backend="ort-cpu", threads=1, log=lines.append).close()
    assert not [ln for ln in lines if ln.startswith("attention:")], lines


@pytest.mark.skipif(not ort_version_ok(REAL.__version__),
                    reason=f"onnxruntime {REAL.__version__} has no fused kernel to run")
def test_the_fused_graph_runs_from_1_27_without_the_version_line(tiny_bundle_int8_static, monkeypatch):
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    lines = []
    with open_runtime(tiny_bundle_int8_static, backend="ort-cpu", threads=1, log=lines.append) as rt:
        assert rt.backend.fused is not None
    assert not [ln for ln in lines if ln.startswith("attention:")], lines  # its own line goes to stderr (ort.py)


# --- query_seqlens: 1.32 -----------------------------------------------------------------------

@pytest.mark.skipif(REAL_VERSION < QUERY_LENGTHS_ORT,
                    reason=f"onnxruntime {REAL.__version__}: the fused graph with query_seqlens cannot load here")
def test_query_seqlens_gate(tiny_bundle_int8_static, monkeypatch):
    """1.27-1.31: the fused graph runs one stream without query_seqlens, and serve's fused slots
    say which release they need; 1.32: the input is there."""
    b = load_bundle(tiny_bundle_int8_static)
    monkeypatch.setattr(ort_mod, "_import_ort", lambda: Ort("1.29.0"))
    be = ort_mod.OrtBackend(b, threads=1, attention="auto")
    assert be.fused is not None and not be.query_lengths
    assert QUERY_LENGTHS not in {i.name for i in be.session.get_inputs()}
    with pytest.raises(BackendUnavailable, match=r"query_seqlens.*1\.32.*1\.29\.0"):
        be.slot_memory(2)
    cache = KVCache(b, 32, memory=be.memory)
    seq = new_sequence(cache)
    assert np.isfinite(run_stream(be, cache, seq, np.array([[5, 6, 7]]), np.array([[2]]))).all()
    be.close()
    monkeypatch.setattr(ort_mod, "_import_ort", lambda: Ort("1.32.0"))
    be = ort_mod.OrtBackend(b, threads=1, attention="auto")
    assert be.query_lengths and QUERY_LENGTHS in {i.name for i in be.session.get_inputs()}
    be.close()


# --- 8-bit block weights: onnxruntime fuses them from 1.25 ---------------------------------------

@pytest.mark.parametrize("version,fuses", [("1.20.1", False), (JETPACK6_ORT, False), ("1.24.4", False),
                                           ("1.25.0", True), ("1.32.0", True)])
def test_the_8bit_fusion_gate(version, fuses):
    assert fuses_8bit(version) is fuses
    assert NBITS8_FUSION_ORT == (1, 25)


def test_the_8bit_line():
    assert Nbits8Report("1.32.0", found=3).line() is None  # onnxruntime fuses them itself
    assert Nbits8Report("1.24.4", found=2, rewritten=2, kernel=True).line() is None
    assert Nbits8Report("1.24.4", found=0).line() is None
    line = Nbits8Report(JETPACK6_ORT, found=1).line()
    assert line.startswith(f"weights: onnxruntime {JETPACK6_ORT} fuses 8-bit block weights into MatMulNBits "
                           "only from 1.25")
    assert "1 matrix runs as DequantizeLinear -> MatMul" in line and "not rewritten" in line
    line = Nbits8Report("1.20.1", found=3, kernel=False, accuracy=4).line()
    assert "3 matrices run" in line and "kernel does not run at accuracy level 4" in line


K, N, BLOCK = 96, 40, 32


def product(codes_type=T.INT8, zero_points=False, fp16_scale=True, k=K, handed=False):
    """A one-product graph as the exporter writes it: DequantizeLinear(codes, scale[, zp], axis 0,
    block) -> MatMul; (the serialized graph, the Handed of its placeholders, the float weight)."""
    rng = np.random.default_rng(k + 7 * zero_points + 3 * (codes_type == T.UINT8))
    lo, hi, dt = (-128, 128, np.int8) if codes_type == T.INT8 else (0, 256, np.uint8)
    blocks = -(-k // BLOCK)
    codes = rng.integers(lo, hi, (k, N)).astype(dt)
    scale = (rng.random((blocks, N)) * 0.02 + 1e-3).astype(np.float16 if fp16_scale else np.float32)
    zp = rng.integers(lo // 8, hi // 8, (blocks, N)).astype(dt) if zero_points else None
    nodes, inits, given = [], [], []
    if handed:
        inits.append(handed_tensor("w_codes", codes))
        given.append(("w_codes", codes))
    else:
        inits.append(nh.from_array(codes, "w_codes"))
    if fp16_scale:
        inits.append(nh.from_array(scale, "w_scale_f16"))
        nodes.append(h.make_node("Cast", ["w_scale_f16"], ["w_scale"], to=T.FLOAT))
    else:
        inits.append(nh.from_array(scale, "w_scale"))
    ins = ["w_codes", "w_scale"]
    if zp is not None:
        inits.append(nh.from_array(zp, "w_zp"))
        ins.append("w_zp")
    nodes += [h.make_node("DequantizeLinear", ins, ["w"], axis=0, block_size=BLOCK),
              h.make_node("MatMul", ["x", "w"], ["y"], name="the_product")]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["M", k])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["M", N])], inits)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 21)], ir_version=10)
    s = np.repeat(scale.astype(np.float32), BLOCK, axis=0)[:k]
    z = 0 if zp is None else np.repeat(zp.astype(np.float32), BLOCK, axis=0)[:k]
    return model.SerializeToString(), Handed(given), (codes.astype(np.float32) - z) * s


def run(graph: bytes, handed: Handed, x: np.ndarray, accuracy: int) -> np.ndarray:
    opts = REAL.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy))
    keep = handed.hand_to(REAL, opts)  # noqa: F841 (alive while the session is made and run)
    s = REAL.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def ops(graph: bytes) -> list[str]:
    return [n.op_type for n in onnx.load_from_string(graph).graph.node]


CASES = {"int8, fp16 scale": {}, "int8, zero points": {"zero_points": True},
         "uint8, zero points, float scale": {"codes_type": T.UINT8, "zero_points": True, "fp16_scale": False},
         "uint8, no zero point": {"codes_type": T.UINT8}, "handed codes": {"handed": True}}


@pytest.mark.parametrize("accuracy", [0, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_fuse_8bit_writes_the_product_onnxruntime_1_25_would(case, accuracy):
    """Below 1.25 (here: the installed release reporting 1.24.4) every 8-bit block product becomes
    one MatMulNBits, computing the same product: to float rounding at accuracy 0 and to int8
    activation rounding at 4, and, where the installed release fuses 8-bit itself (1.25+), bit for
    bit what its own fusion computes, on one row and on many."""
    if not kernel_runs(REAL, accuracy):
        pytest.skip(f"onnxruntime {REAL.__version__} has no 8-bit MatMulNBits kernel at accuracy level {accuracy}")
    graph, handed, w = product(**CASES[case])
    assert len(eight_bit_products(onnx.load_from_string(graph).graph)) == 1
    out, given, report = fuse_8bit(graph, ".", handed, Ort("1.24.4"), accuracy)
    assert (report.found, report.rewritten, report.kernel) == (1, 1, True) and report.line() is None
    assert ops(out) == ["MatMulNBits"]  # the DequantizeLinear and the scale's Cast are gone
    node = onnx.load_from_string(out).graph.node[0]
    assert {a.name: h.get_attribute_value(a) for a in node.attribute} == {
        "K": K, "N": N, "bits": 8, "block_size": BLOCK, "accuracy_level": accuracy}
    if CASES[case].get("handed"):
        assert "w_codes" not in dict(given.buffers)  # its placeholder is no longer read
    x = np.random.default_rng(3).standard_normal((5, K)).astype(np.float32)
    got = run(out, given, x, accuracy)
    want = x @ w
    tol = 1e-5 if accuracy == 0 else 3e-2
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    rows = np.concatenate([run(out, given, x[i:i + 1], accuracy) for i in range(5)])
    if fuses_8bit(REAL.__version__):  # the release's own fusion of the graph as written
        assert "MatMulNBits" in optimized_ops(graph, handed, accuracy)
        assert np.array_equal(got, run(graph, handed, x, accuracy))
        assert np.array_equal(rows, np.concatenate([run(graph, handed, x[i:i + 1], accuracy) for i in range(5)]))


def optimized_ops(graph: bytes, handed: Handed, accuracy: int) -> list[str]:
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        opts = REAL.SessionOptions()
        opts.log_severity_level = 3
        opts.optimized_model_filepath = os.path.join(d, "opt.onnx")
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(accuracy))
        keep = handed.hand_to(REAL, opts)  # noqa: F841
        REAL.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
        return [n.op_type for n in onnx.load(opts.optimized_model_filepath, load_external_data=False).graph.node]


def test_fuse_8bit_a_partial_last_block():
    if not kernel_runs(REAL, 0):
        pytest.skip(f"onnxruntime {REAL.__version__} has no 8-bit MatMulNBits kernel at accuracy level 0")
    graph, handed, w = product(k=K + 16)
    out, given, report = fuse_8bit(graph, ".", handed, Ort("1.24.4"), 0)
    assert report.rewritten == 1
    x = np.random.default_rng(4).standard_normal((3, K + 16)).astype(np.float32)
    want = x @ w
    assert np.abs(run(out, given, x, 0) - want).max() <= 1e-5 * np.abs(want).max()


def test_fuse_8bit_leaves_the_graph_where_it_should():
    graph, handed, _ = product()
    # onnxruntime 1.25+ fuses it itself: nothing to do, nothing said
    out, given, report = fuse_8bit(graph, ".", handed, Ort("1.25.0"), 4)
    assert out is graph and given is handed and report.line() is None
    # another device's provider: as written
    out, _, report = fuse_8bit(graph, ".", handed, Ort("1.24.4"), 4, device="cuda")
    assert out is graph and report.found == 0
    # no 8-bit kernel (the probe's session fails, as 1.20.1's does at level 4): as written, and said

    def no_kernel(model, *a, **kw):
        if b"MatMulNBits" in (model if isinstance(model, bytes) else b""):
            raise RuntimeError("MatMulNBits: only 4 bits")
        return REAL.InferenceSession(model, *a, **kw)

    out, given, report = fuse_8bit(graph, ".", handed, Ort("1.20.1", session=no_kernel), 4)
    assert out is graph and (report.found, report.rewritten, report.kernel) == (1, 0, False)
    assert "1 matrix runs as DequantizeLinear -> MatMul" in report.line() and "accuracy level 4" in report.line()
    # a 4-bit product is onnxruntime's own fusion since 1.19: not touched
    four = onnx.load_from_string(graph)
    four.graph.initializer[0].CopyFrom(h.make_tensor("w_codes", T.INT4, [K, N], [1] * (K * N)))
    assert eight_bit_products(four.graph) == []


# --- a bundle with an 8-bit head (the quickstart's kinds of blocks, tiny) ------------------------

def test_a_bundles_8bit_head_below_1_25(tiny_bundle_int8_wint4, monkeypatch):
    """The bundle's Q8_0 head below 1.25: the backend writes it as MatMulNBits (where it calls
    fuse_8bit: ort.py) and its logits equal the installed release's own, or the load log says it
    runs as written. Either way the runtime runs it."""
    assert len(eight_bit_products(onnx.load(str(load_bundle(tiny_bundle_int8_wint4).onnx_path),
                                            load_external_data=False).graph)) >= 1
    monkeypatch.delenv(ATTENTION_ENV, raising=False)

    def greedy(rt):
        g = reference(rt)
        rows = [g.prefill(list(range(5, 20))).copy()]
        for _ in range(4):
            rows.append(g.decode_step(int(np.argmax(rows[-1]))).copy())
        return np.stack(rows)

    real_rows = None
    if fuses_8bit(REAL.__version__):
        with open_runtime(tiny_bundle_int8_wint4, backend="ort-cpu", threads=1, log=None) as rt:
            real_rows = greedy(rt)
    as_version(monkeypatch, "1.24.4")
    lines = []
    with open_runtime(tiny_bundle_int8_wint4, backend="ort-cpu", threads=1, log=lines.append) as rt:
        rows = greedy(rt)
        report = getattr(rt.backend, "nbits8", None)
        said = [ln for ln in lines if ln.startswith("weights: onnxruntime 1.24.4")]
        assert said == [ln for ln in ort_version_lines(rt.backend, rt.bundle) if ln.startswith("weights:")]
    assert np.isfinite(rows).all()
    if report is not None and report.kernel:  # rewritten at load
        assert report.rewritten == report.found >= 1 and not said
        if real_rows is not None:
            assert np.array_equal(rows, real_rows)
    else:  # as written (no rewrite in the backend, or no kernel): one line says so
        assert len(said) == 1 and "as DequantizeLinear -> MatMul" in said[0], lines
