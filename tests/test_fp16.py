"""`edgekv export --dtype float16`: fp16 weights and compute for GPU bundles, parity-checked."""
import json

import numpy as np
import onnx
import pytest

from edgekv.runtime.backends import OrtBackend
from edgekv.runtime.cache import KVCache
from tests.stream_reference import Generator
from edgekv.format.bundle import load_bundle
from tests.conftest import cli


@pytest.fixture(scope="module")
def fp16_bundle(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16") / "tiny-float-fp16"
    r = cli("export", tiny_llama, "--kv", "float", "--dtype", "float16", "--out", out,
                   "--max-context", "256", "--steps", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "✓ logits (decode)" in r.stderr and "fp16 noise" in r.stderr
    return out


def test_fp16_bundle_is_fp16_and_says_so(fp16_bundle):
    man = json.loads((fp16_bundle / "edgekv.json").read_text())
    assert man["dtype"] == "float16" and man["parity"]["passed"]
    m = onnx.load(str(fp16_bundle / "model.onnx"), load_external_data=False)
    big = [t for t in m.graph.initializer if np.prod(t.dims) >= 4096]
    assert big and all(t.data_type == onnx.TensorProto.FLOAT16 for t in big)  # the weights
    types = {i.name: i.type.tensor_type.elem_type for i in list(m.graph.input) + list(m.graph.output)}
    assert types["past.0.key"] == onnx.TensorProto.FLOAT16  # the float cache is fp16 too
    assert types["logits"] == onnx.TensorProto.FLOAT  # logits leave as float32
    b = load_bundle(fp16_bundle)
    assert KVCache(b, 16).buffers["past.0.key"].dtype == np.float16
    assert b.kv_bytes_per_token() * 2 == load_bundle(fp16_bundle).scheme.bytes_per_token(
        b.model["n_layers"], b.model["n_kv_heads"], b.model["head_dim"], 4)


def test_fp16_logits_follow_the_fp32_bundle(fp16_bundle, tiny_bundle_float):
    """Same weights, fp16 against fp32, through the runtime: close, and the same greedy tokens."""
    seq = [int(x) for x in np.random.default_rng(0).integers(3, 300, 24)]
    out = []
    for path in (tiny_bundle_float, fp16_bundle):
        b = load_bundle(path)
        g = Generator(OrtBackend(b, threads=1, max_logits_rows=24), KVCache(b, 64))
        out.append(g.prefill(seq, all_logits=True).copy())
    a, h = out
    assert np.abs(a - h).max() < 0.05 * np.abs(a).max()
    assert (a.argmax(-1) == h.argmax(-1)).mean() >= 0.9
