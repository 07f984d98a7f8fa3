"""The tests' trace cache (tests/trace_cache.py): a reused trace is byte for byte the graph a fresh
trace of the same model writes (with another model's weights of the same structure), and anything
that changes the structure changes the key. Oracle: torch.onnx itself, traced afresh."""
from __future__ import annotations

import torch

from export.model import Transformer
from export.model_config import ModelConfig
from tests.trace_cache import cache_key, cached

CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96, hidden_size=32,
              intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
              bos_token_id=1, eos_token_id=2)


def model(seed: int, kv: str = "int8-static", **change) -> Transformer:
    m = Transformer(ModelConfig.from_hf_dict(CONFIG | change), kv).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the buffers too (the static scales): values the graph must carry
        for t in [*m.parameters(), *m.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=g) + 0.1)
    return m


def test_a_reused_trace_is_the_fresh_trace_of_the_new_weights(tmp_path):
    import export.onnx_export as oe

    trace = getattr(oe._trace, "__wrapped__", oe._trace)  # conftest may have wrapped it already
    traced = cached(trace, tmp_path)
    first, second = model(1), model(2)
    assert cache_key(first) == cache_key(second)
    traced(first)  # a miss: traced and stored
    assert len(list(tmp_path.glob("*.onnx"))) == 1
    hit = traced(second)
    assert not hasattr(hit, "exported_program")  # from the cache, not traced again
    fresh = trace(second).model_proto
    assert hit.model_proto.SerializeToString() == fresh.SerializeToString()


def test_a_reused_trace_of_a_model_with_local_layers_takes_the_new_weights(tmp_path, arch_folders):
    """Gemma 3's graph is traced inside LocalMaskGraph: its tensors are named `model.*` there."""
    import export.onnx_export as oe
    from tests.test_stamp import model_of

    trace = getattr(oe._trace, "__wrapped__", oe._trace)
    traced = cached(trace, tmp_path)
    first, second = (model_of("gemma3", arch_folders("gemma3"), "int8", 1) for _ in range(2))
    with torch.no_grad():
        for t in second.parameters():
            t.add_(0.25)
    traced(first)
    hit = traced(second)
    assert not hasattr(hit, "exported_program")
    assert hit.model_proto.SerializeToString() == trace(second).model_proto.SerializeToString()


def test_what_changes_a_trace_changes_the_key():
    base = cache_key(model(1))
    assert cache_key(model(1, kv="int8")) != base  # the KV scheme
    assert cache_key(model(1, num_key_value_heads=4)) != base  # a shape
    assert cache_key(model(1, rope_theta=500000.0)) != base  # a config value the graph computes with
    m = model(1)
    m.layers[0].attn.factored = not m.layers[0].attn.factored  # a module's flag
    assert cache_key(m) != base
    untied = model(1)
    untied.lm_head.weight = torch.nn.Parameter(untied.embed.weight.detach().clone())  # the head no longer the table
    assert cache_key(untied) != base
    shared = model(1)
    shared.lm_head.weight = torch.nn.Parameter(shared.embed.weight.data)  # the same memory, another parameter
    assert cache_key(shared) not in (base, cache_key(untied))
    h = model(1)
    h.layers[0].register_forward_hook(lambda *a: None)  # a hook: never reused
    assert cache_key(h) != base
