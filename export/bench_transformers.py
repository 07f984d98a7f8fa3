"""Hugging Face transformers (eager, same weights, same threads) decode speed: the anchor that
`edgekv bench --transformers MODEL` compares against. Workstation side: it needs torch.

  python -m export.bench_transformers [MODEL] [--prompt-tokens 64] [--decode-tokens 64] [--threads N]
prints one JSON line."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from export.recipes import resolve_source
from export.checkpoint_names import unfuse


def hf_model(src):
    import transformers

    c = src.config
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
              num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
              head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
              tie_word_embeddings=c.tie_word_embeddings, max_position_embeddings=c.max_position_embeddings)
    if c.arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**kw), transformers.Qwen2ForCausalLM
    else:
        cfg, cls = transformers.LlamaConfig(attention_bias=c.attention_bias, **kw), transformers.LlamaForCausalLM
    cfg._attn_implementation = "eager"
    m = cls(cfg).eval()
    m.load_state_dict(unfuse(src.state_dict, c), strict=not c.tie_word_embeddings)
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    src, _ = resolve_source(a.model)
    m = hf_model(src)
    ids = torch.tensor([np.random.default_rng(0).integers(100, 30000, a.prompt_tokens)])
    tps = []
    with torch.inference_mode():
        for _ in range(a.repeat + 1):
            out = m(ids, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(a.decode_tokens):
                out = m(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            tps.append(a.decode_tokens / (time.perf_counter() - t0))
    print(json.dumps({"transformers_decode_tps": statistics.median(tps[1:]), "threads": torch.get_num_threads(),
                      "prompt_tokens": a.prompt_tokens, "decode_tokens": a.decode_tokens}))


if __name__ == "__main__":
    main()
