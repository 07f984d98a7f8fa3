"""Every supported architecture against its oracle, on tiny random checkpoints of its real config
(tests/archs.py): transformers for the torch model (logits, greedy tokens with and without a
cache), the exporter's parity check for ONNX = torch, gguf + llama.cpp's layout for the GGUF path,
transformers' apply_chat_template for the template render through edgekv's sandbox."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from export.gguf_loader import load_gguf
from export.loaders import load_hf_folder
from export.model import Transformer, causal_mask
from export.model_config import UnsupportedModel
from tests.archs import ARCHS, write_arch_gguf
from tests.stream_reference import reference

S = 72  # past original_max_position_embeddings (llama3 and phi: 64), gemma's window 8
EXPORTED = ["llama3.2", "qwen2.5", "qwen3", "smollm3", "phi4-mini"]  # gemma3: tests/test_gemma3.py


@pytest.fixture(scope="session")
def folders(arch_folders):
    return arch_folders  # conftest's: made once per run, shared with test_gemma3 and the fused tests


def ours_from(src, context: int | None = None):
    """Our model of `src`, as a bundle of `context` positions would have it (LongRoPE's factor set)."""
    m = Transformer(src.config.for_context(context) if context else src.config, "float").eval()
    m.load_state_dict(src.state_dict, strict=False)
    return m


def hf_model(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def key_positions(model, p, s):
    """Our torch model's sliding-window input: the key slot j holds position j (a linear cache)."""
    return torch.arange(p + s)[None] if model.cfg.local_layers else None


def forward(model, ids, p=0, past=None):
    s = ids.shape[1]
    kw = {"key_positions": key_positions(model, p, s)} if model.cfg.local_layers else {}
    out = model(ids, torch.arange(p, p + s)[None], causal_mask(p, s), torch.arange(s)[None],
                *(past or model.past_like(0, 1)), **kw)
    return out[0][0], list(out[1:])


def greedy_cached(model, prompt, n):
    """Prefill, then one token at a time through our cache: the tokens and each step's logits."""
    logits, past = forward(model, prompt)
    toks, steps = [], [logits[-1]]
    for _ in range(n):
        toks.append(int(steps[-1].argmax()))
        p = past[0].shape[0]
        logits, present = forward(model, torch.tensor([[toks[-1]]]), p, past)
        past = [torch.cat([a, b], 0) for a, b in zip(past, present)]
        steps.append(logits[-1])
    return toks, steps


@pytest.mark.parametrize("name", ARCHS)
def test_torch_matches_transformers(name, folders):
    """Logits over S positions, and greedy decoding with and without a cache, both sides (24
    positions: within LongRoPE's original context, where transformers takes the short factors)."""
    folder = folders(name)
    src = load_hf_folder(folder)
    hf, ours = hf_model(folder), ours_from(src)
    ids = torch.randint(0, 384, (1, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # S > 64: transformers takes LongRoPE's long factors for all of it
        out, _ = forward(ours_from(src, context=S), ids)
        assert ref.abs().max() > 0.1  # not degenerate
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)
        prompt, n = ids[:, :12], 12
        hf_cached = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False, use_cache=True, min_new_tokens=n,
                                eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
        hf_plain = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False, use_cache=False, min_new_tokens=n,
                               eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
        toks, steps = greedy_cached(ours, prompt, n)
        uncached = forward(ours, torch.cat([prompt, torch.tensor([toks])], 1))[0][11:]
    assert hf_cached == hf_plain == toks
    torch.testing.assert_close(torch.stack(steps), uncached, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("name", [n for n in ARCHS if n != "gemma3"])
def test_gguf_gives_the_hf_folders_weights(name, folders, tmp_path):
    """llama.cpp's layout of the same checkpoint loads to the same state dict and config, and
    the same logits (RoPE parameters read from the GGUF's tensors and keys)."""
    folder = folders(name)
    a = load_hf_folder(folder)
    b = load_gguf(write_arch_gguf(folder, tmp_path / "m.gguf"))
    assert set(a.state_dict) == set(b.state_dict)
    for k in a.state_dict:
        torch.testing.assert_close(b.state_dict[k], a.state_dict[k], atol=0, rtol=0, msg=k)
    for f in ("n_heads", "n_kv_heads", "head_dim", "rotary_dim", "nope_layers", "qk_norm", "tie_word_embeddings",
              "attention_bias"):
        assert getattr(a.config, f) == getattr(b.config, f), f
    ids = torch.randint(0, 384, (1, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(forward(ours_from(b), ids)[0], forward(ours_from(a), ids)[0], atol=1e-5, rtol=1e-5)


# --- export: ONNX = torch (the exporter's parity check), int8 KV greedy, check-trt -------------

SLOW_EXPORTS = ("llama3.2", "qwen2.5")  # today's Llama and Qwen2 graphs (tests/test_model_vs_hf.py covers them fast)


def context_of(name):
    # room for the parity prompt (the template's) and its steps; LongRoPE: within the original
    # context of 64 (the short factors: what transformers computes there)
    return 64 if name.startswith("phi") else 128


@pytest.fixture(scope="session")
def int8_bundles(arch_bundles):
    """name -> its int8-KV bundle (conftest's arch_bundles: export_bundle, which raises unless
    parity and check-trt pass)."""
    return lambda name: arch_bundles(name, "int8", context_of(name))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_EXPORTS else n
                                  for n in EXPORTED])
def test_int8_bundle_greedy_follows_transformers(name, folders, int8_bundles):
    """The int8-KV bundle (ONNX = torch by the exporter's parity check, which it passed) decodes
    transformers' greedy tokens through the runtime, a different token only where transformers'
    own top two are within the parity tolerance (quantization noise), and nothing after it compared."""
    from edgekv.format.bundle import load_bundle
    from edgekv.runtime.assemble import open_runtime

    path = int8_bundles(name)
    manifest = load_bundle(path).manifest
    assert manifest["parity"]["passed"] and manifest["trt_check"] == {"10.3": "pass"}
    tol = manifest["parity"]["outputs"]["logits (decode)"]["tol"]
    prompt = torch.randint(0, 384, (1, 12), generator=torch.Generator().manual_seed(3))
    n = 16
    hf = hf_model(folders(name))
    with torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False, min_new_tokens=n, eos_token_id=None,
                          pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    ref, scores = out.sequences[0, 12:].tolist(), [s[0].numpy() for s in out.scores]
    with open_runtime(path, 64, "ort-cpu", threads=1) as rt:
        gen = reference(rt)
        logits = gen.prefill(prompt[0].tolist())
        toks = []
        for _ in range(n):
            toks.append(int(np.argmax(logits)))
            logits = gen.decode_step(toks[-1])
    for i, (a, b) in enumerate(zip(ref, toks)):
        if a != b:
            assert scores[i][a] - scores[i][b] <= tol, (i, ref, toks)
            break
    else:
        assert toks == ref


def test_gemma3_gguf_refused_in_one_line(folders, tmp_path):
    """Gemma 3's GGUF carries a SentencePiece tokenizer edgekv does not read: the export of the
    file stops with one line naming it, before writing anything (its HF folder exports:
    tests/test_gemma3.py)."""
    from tests.conftest import run_edgekv

    path = write_arch_gguf(folders("gemma3"), tmp_path / "g.gguf")
    with pytest.raises(UnsupportedModel, match="SentencePiece"):
        load_gguf(path)
    r = run_edgekv("export", path, "--out", tmp_path / "g", "--kv", "float", timeout=600)
    assert r.returncode != 0 and not (tmp_path / "g").exists()
    assert "SentencePiece" in r.stderr.strip().splitlines()[-1] and "Traceback" not in r.stderr


# --- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("change, message", [
    ({"architectures": ["Qwen3MoeForCausalLM"]}, "Qwen3-MoE"),
    ({"architectures": ["Gemma3ForConditionalGeneration"]}, "vision tower"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, "unsupported rope scaling 'yarn'"),
    ({"use_sliding_window": True, "sliding_window": 16}, "sliding-window attention"),
])
def test_unsupported_variants_refused_in_one_line(change, message, folders, tmp_path):
    import shutil

    from tests.conftest import run_edgekv

    folder = tmp_path / "m"
    shutil.copytree(folders("qwen3"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(UnsupportedModel, match=message):
        load_hf_folder(folder)
    if "MoE" in message:  # the CLI: the same line, no traceback
        r = run_edgekv("export", folder, "--out", tmp_path / "o")
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr


# --- chat templates through edgekv's sandbox -------------------------------------------------

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "<think>\nthey greet\n</think>\n\nHello!"},
                {"role": "user", "content": "Capital of France?"}]


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("thinking", [None, True, False])
def test_chat_template_renders_as_transformers(name, thinking, folders):
    """Each family's template style rendered by edgekv's bounded sandbox = transformers'
    apply_chat_template (enable_thinking passed only when given: the template's default else)."""
    from transformers import PreTrainedTokenizerFast

    from edgekv.runtime.text import TextCodec

    folder = folders(name)
    src = load_hf_folder(folder)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|endoftext|>",
                                  eos_token="<|im_end|>")
    kw = {} if thinking is None else {"enable_thinking": thinking}
    ref = tok.apply_chat_template(CONVERSATION, chat_template=src.chat_template, tokenize=False,
                                  add_generation_prompt=True, **kw)

    class B:  # what TextCodec reads of a bundle
        tokenizer_path = folder / "tokenizer.json"
        special = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
        chat_template = src.chat_template
        path = folder

    codec = TextCodec(B())
    assert codec.render(CONVERSATION, enable_thinking=thinking) == ref
    assert codec.with_thinking(thinking).render(CONVERSATION) == ref  # chat --thinking off's codec


def test_gemma3_windowed_cache_equals_the_full_cache_masked(folders):
    """The local layers keeping only their window of K/V (a per-layer capacity, the slots a
    ring would hold) give the same logits as the full cache with the out-of-window keys
    masked, decoding well past the window (torch only: the runtime's windowed cache is phase 2 of
    docs/models.md; the full-capacity cache with local_key_mask runs: tests/test_gemma3.py)."""
    model = ours_from(load_hf_folder(folders("gemma3")))
    cfg, W = model.cfg, model.cfg.sliding_window
    local = set(cfg.local_layers)
    ids = torch.randint(0, 384, (1, 3 * W + 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, full = forward(model, ids[:, :W])  # prefill W tokens, then one at a time
        windowed = list(full)
        for t in range(W, ids.shape[1]):
            tok = ids[:, t:t + 1]
            a, pres_a = forward(model, tok, t, full)
            keep = W - 1  # a local layer's past: the last W - 1 positions (the query is the W-th)
            trimmed = [x[-keep:] if i // 2 in local else x for i, x in enumerate(windowed)]
            p_local = trimmed[0 if 0 in local else 2 * min(local)].shape[0]
            out = model(tok, torch.tensor([[t]]), causal_mask(t, 1), torch.tensor([[0]]), *trimmed,
                        key_positions=torch.arange(t + 1)[None],
                        local_key_positions=torch.arange(t - p_local, t + 1)[None])
            torch.testing.assert_close(out[0][0], a[-1:], atol=1e-5, rtol=1e-5)  # float reassociation only
            full = [torch.cat([x, y], 0) for x, y in zip(full, pres_a)]
            windowed = [torch.cat([x, y], 0) for x, y in zip(trimmed, out[1:])]
    assert min(x.shape[0] for x in windowed) == W  # the local layers held only their window
