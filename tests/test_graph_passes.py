"""The graph passes (edgekv/graph/): a backend is a list of passes plus a session, and its load
line names the passes that changed the bundle's graph; each pass of the graph package leaves the
index consistent with its graph and does nothing the second time."""
from __future__ import annotations

import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from edgekv.format.bundle import load_bundle  # noqa: E402
from edgekv.graph.index import GraphIndex  # noqa: E402
from edgekv.graph.passes import line, run_passes  # noqa: E402
from edgekv.graph.passes.cache_reads import CacheReads  # noqa: E402
from edgekv.graph.passes.exact_sums import ExactSums  # noqa: E402
from edgekv.graph.passes.minimum_fold import MinimumFold  # noqa: E402
from edgekv.graph.passes.trt_staging import TrtStaging  # noqa: E402
from edgekv.graph.passes.weight_forms import WeightForms  # noqa: E402
from edgekv.runtime.backends.fused import ort_version_ok  # noqa: E402
from edgekv.runtime.backends.ort import OrtBackend  # noqa: E402


def maps(index: GraphIndex) -> tuple:
    """What the index says of its graph, by names (protobuf wrappers are not stable objects)."""
    return ({k: n.name or tuple(n.output) for k, n in index.producer.items()},
            {k: sorted(n.name or str(tuple(n.output)) for n in v) for k, v in index.consumers.items()},
            sorted(index.inits), sorted(index.infos), dict(index.inputs), sorted(index.outputs))


def test_the_load_line_names_the_passes_that_ran(tiny_bundle_int8, capsys):
    be = OrtBackend(load_bundle(tiny_bundle_int8), threads=1, attention="plain")
    assert be.load_line == "ort-cpu graph passes: cache-reads, exact-sums"
    assert capsys.readouterr().err == ""  # the graph as written: no load line (one-line errors stay one line)
    be = OrtBackend(load_bundle(tiny_bundle_int8), threads=1, attention="plain", exact=False)
    assert be.load_line == "ort-cpu graph passes: cache-reads" and not be.exact


def test_the_fused_load_line(tiny_bundle_int8_static, capsys):
    if not ort_version_ok(ort.__version__):
        pytest.skip(f"onnxruntime {ort.__version__} has no fused kernel")
    be = OrtBackend(load_bundle(tiny_bundle_int8_static), threads=1, attention="fused")
    assert be.load_line.startswith("ort-cpu graph passes: fused-attention")
    assert "cache-reads" not in be.load_line and "exact-sums" not in be.load_line
    assert capsys.readouterr().err.splitlines() == [f"{be.attention}; {be.load_line}"]  # one load line


def test_the_weight_passes_name_what_they_did(tiny_bundle_int8_wint4):
    be = OrtBackend(load_bundle(tiny_bundle_int8_wint4), threads=1, attention="plain")
    assert "minimum-fold" in be.load_line and be.minimums.folded > 0


@pytest.mark.parametrize("which", ["int8", "wint4"])
def test_each_pass_keeps_the_index_consistent_and_is_idempotent(which, tiny_bundle_int8, tiny_bundle_int8_wint4):
    b = load_bundle(tiny_bundle_int8 if which == "int8" else tiny_bundle_int8_wint4)
    index = GraphIndex.from_path(b.onnx_path)
    for p in (CacheReads(), ExactSums(b.max_context), MinimumFold(), WeightForms()):
        run_passes(index, [p])
        assert maps(index) == maps(GraphIndex(index.model, index.base_dir)), p.name  # rebuilt: the same
        again = run_passes(index, [p])
        assert not again[0].changed, p.name  # nothing left for it the second time
    have = set(index.inputs) | set(index.inits) | {""}
    for n in index.g.node:  # still in topological order, nothing read that nobody makes
        assert all(x in have for x in n.input), n.name
        have.update(n.output)
    staged = GraphIndex.from_path(b.onnx_path)
    first = run_passes(staged, [TrtStaging()])
    assert not run_passes(staged, [TrtStaging()])[0].changed
    assert line(first, "trt") in ("trt: trt-staging", "trt: none (the graph as written)")
