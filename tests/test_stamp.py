"""Stamped layers (export/stamp.py): the graph made by tracing one layer of each kind and copying
it is the graph made by tracing every layer. Oracle: both graphs run by onnxruntime on the same
random inputs give the same logits and present.* bit for bit; the stamped one has no node the
traced one lacks (it shares what does not vary between layers, so it may have fewer)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

# two kinds of layer each, one of them copied: Gemma 3 (local, local, global: LocalMaskGraph's
# scopes), SmolLM3 (rope, NoPE, rope) under a static cache (per-layer scales as buffers). Three
# layers, not more: the oracle traces every layer, and its cost grows with each one
CASES = [("gemma3", "int8", 3), ("smollm3", "int8-static", 3)]


def model_of(arch: str, folder, kv: str, n_layers: int):
    import json

    import torch

    from export.model import Transformer
    from export.model_config import ModelConfig

    c = json.loads((folder / "config.json").read_text())
    c["num_hidden_layers"] = n_layers
    if arch == "gemma3":  # local, local, global
        c["layer_types"] = [("full" if i % 3 == 2 else "sliding") + "_attention" for i in range(n_layers)]
    if arch == "smollm3":  # 1 = RoPE: layer 1 NoPE
        c["no_rope_layers"] = [0 if i % 3 == 1 else 1 for i in range(n_layers)]
    m = Transformer(ModelConfig.from_hf_dict(c), kv)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every layer's tensors different, so a copy reading the wrong one shows
        for _, t in [*m.named_parameters(), *m.named_buffers()]:
            if t.is_floating_point() and t.dim() >= 1:
                t.copy_(torch.rand(t.shape, generator=g) * 0.3 + (0.02 if t.dim() == 2 else 0.5))
    return m


def feeds_for(session, rng, b: int = 2, s: int = 3, p: int = 9) -> dict:
    sizes = {"batch": b, "seq": s, "total": p + s, "past": p, "nlogits": 2,
             "local_past": p - 2, "local_total": p - 2 + s}  # Gemma 3's local layers: their own past
    feeds = {}
    for i in session.get_inputs():
        shape = [sizes.get(d, d) for d in i.shape]
        if i.name == "position_ids":
            feeds[i.name] = np.tile(np.arange(p, p + s), (b, 1))
        elif i.name == "logits_index":
            feeds[i.name] = np.tile([s - 2, s - 1], (b, 1))
        elif i.type == "tensor(int64)":
            feeds[i.name] = rng.integers(0, 300, size=shape)
        elif i.type == "tensor(bool)":
            feeds[i.name] = rng.random(shape) < 0.8
        elif i.type == "tensor(int8)":
            feeds[i.name] = rng.integers(-127, 128, size=shape).astype(np.int8)
        elif i.type == "tensor(float16)":
            feeds[i.name] = rng.uniform(0.01, 0.05, size=shape).astype(np.float16)
        else:
            feeds[i.name] = rng.normal(size=shape).astype(np.float32)
    return feeds


@pytest.fixture(scope="module")
def graphs(arch_folders):
    """case -> (model, stamped graph, traced graph, the trace of one layer per kind that the
    stamped graph was made from: kept as it was traced, not traced again)."""
    import export.onnx_export as oe

    out = {}
    for arch, kv, n in CASES:
        m = model_of(arch, arch_folders(arch), kv, n)
        views, trace = [], oe._trace

        def kept(model):
            program = trace(model)
            views.append(program.model_proto)
            return program

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(oe, "_trace", kept)
            stamped = oe.export_onnx(m, stamp=True)
        assert len(views) == 1
        out[arch] = m, stamped, oe.export_onnx(m, stamp=False), views[0]
    return out


@pytest.mark.parametrize("arch", [c[0] for c in CASES])
def test_stamped_graph_runs_as_the_traced_one(graphs, arch):
    import onnxruntime as ort

    from export.stamp import representatives

    m, stamped, traced, _ = graphs[arch]
    assert len(representatives(m)) < m.cfg.n_layers  # some layers were copied, not traced
    # stamped, not the fallback's trace: the shape arithmetic torch writes per layer is made once
    assert len(stamped.graph.node) < len(traced.graph.node)
    extra = Counter(n.op_type for n in stamped.graph.node) - Counter(n.op_type for n in traced.graph.node)
    assert not extra, f"the stamped graph has nodes the traced one lacks: {dict(extra)}"
    assert [v.name for v in stamped.graph.input] == [v.name for v in traced.graph.input]
    assert [v.name for v in stamped.graph.output] == [v.name for v in traced.graph.output]
    a, b = (ort.InferenceSession(g.SerializeToString(), providers=["CPUExecutionProvider"]) for g in (stamped, traced))
    rng = np.random.default_rng(0)
    for _ in range(2):
        feeds = feeds_for(a, rng)
        for name, x, y in zip([o.name for o in a.get_outputs()], a.run(None, feeds), b.run(None, feeds)):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert np.array_equal(x, y), f"{arch} {name}: max |diff| {np.abs(x.astype(float) - y).max()}"


def test_unrecognised_layers_are_not_stamped(graphs):
    """A traced graph whose layer scopes are missing gives None (the exporter then traces every
    layer), not a wrong graph."""
    from export.stamp import representatives, stamp_layers
    from edgekv.format.bundle import io_names

    m, _, _, traced = graphs["smollm3"]
    reps = representatives(m)
    names = io_names(m.cfg.n_layers, m.scheme)
    view_names = io_names(len(reps), m.scheme)
    assert stamp_layers(traced, m, reps, view_names, names) is not None  # (graph, weights)
    inside = [n for n in traced.graph.node if any("layers." in p.value for p in n.metadata_props
                                                   if p.key == "pkg.torch.onnx.name_scopes")]
    inside[len(inside) // 2].ClearField("metadata_props")  # a node amid a layer's run outside every layer
    assert stamp_layers(traced, m, reps, view_names, names) is None
    for n in traced.graph.node:  # torch's module scopes gone
        n.ClearField("metadata_props")
    assert stamp_layers(traced, m, reps, view_names, names) is None


def test_with_layers_is_a_view(graphs):
    """The traced view shares the model's modules and renumbers its layers' kinds."""
    m = graphs["gemma3"][0]
    view = m.with_layers([0, 2])
    assert view.layers[1] is m.layers[2] and view.embed is m.embed and view.lm_head is m.lm_head
    assert view.cfg.n_layers == 2 and view.cfg.local_layers == (0,) and view.layer_rope == ["local", "global"]
    assert len(m.layers) == 3 and m.cfg.n_layers == 3  # the model itself untouched
