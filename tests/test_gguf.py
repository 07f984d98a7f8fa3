"""GGUF loading: a tiny GGUF written here from a random HF checkpoint (with llama.cpp's q/k row
permutation) must load to the same weights and logits; the real GGUF's tokenizer must encode
like transformers' own GGUF tokenizer conversion."""
import json

import pytest
import torch

from export.gguf_loader import load_gguf
from export.loaders import load_hf_folder
from export.model import Transformer, causal_mask
from tests.archs import write_arch_gguf
from tests.conftest import make_hf_folder


def write_gguf(folder, path, quant=None, encode=None):
    """The Llama checkpoint `folder` as llama.cpp's layout (tests/archs.py's writer: q/k rows
    permuted, a one-line chat template); quant/encode as there."""
    return write_arch_gguf(folder, path, quant, encode, chat_template="{{ messages[0]['content'] }}")


def test_gguf_loads_same_model_as_hf_folder(tmp_path):
    folder = make_hf_folder(tmp_path / "hf", "llama")
    write_gguf(folder, tmp_path / "tiny.gguf")
    a, b = load_hf_folder(folder), load_gguf(tmp_path / "tiny.gguf")
    assert a.config.n_heads == b.config.n_heads and a.config.head_dim == b.config.head_dim
    assert set(a.state_dict) == set(b.state_dict)
    for k in a.state_dict:
        torch.testing.assert_close(a.state_dict[k], b.state_dict[k], msg=k)
    ids = torch.randint(0, a.config.vocab_size, (1, 12))
    outs = []
    for src in (a, b):
        m = Transformer(src.config).eval()
        m.load_state_dict(src.state_dict, strict=False)
        with torch.no_grad():
            outs.append(m(ids, torch.arange(12)[None], causal_mask(0, 12), torch.tensor([[11]]),
                          *m.past_like(0, 1))[0])
    torch.testing.assert_close(outs[0], outs[1])
    # the tokenizer rebuilt from GGUF metadata encodes like the original tokenizer.json
    from tokenizers import Tokenizer

    orig = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rebuilt = Tokenizer.from_str(b.tokenizer_json)
    for text in ["The capital of France is Paris.", "naïve 東京 🙂 <|im_start|>user\nhi<|im_end|>"]:
        assert rebuilt.encode(text).ids == orig.encode(text).ids


def test_corrupt_gguf_refused(tmp_path):
    from export.source import SourceError

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(SourceError, match="not a readable GGUF"):
        load_gguf(bad)


@pytest.mark.slow
def test_real_gguf_tokenizer_matches_transformers():
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from export.recipes import DEFAULT_RECIPE, MODELS_DIR, recipe_path

    path = recipe_path(json.loads((MODELS_DIR / f"{DEFAULT_RECIPE}.json").read_text()) | {"name": DEFAULT_RECIPE})
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    import gguf

    from export.gguf_loader import gguf_tokenizer_json

    r = gguf.GGUFReader(str(path))
    field = lambda k, d=None: r.fields[k].contents() if k in r.fields else d  # noqa: E731
    ours = Tokenizer.from_str(gguf_tokenizer_json(field, field("tokenizer.ggml.tokens")))
    for text in ["What is the capital of France?", "Numbers 12345 and 3.14159, emoji 🙂, 東京, naïve café\n\n  x\tf()",
                 "<|im_start|>user\nhi<|im_end|>\n", "I'm sure they'll say   spaces   matter.\r\n"]:
        assert ours.encode(text, add_special_tokens=False).ids == hf.encode(text, add_special_tokens=False)


def test_a_gguf_header_is_parsed_once_per_version_of_the_file(tmp_path):
    """read_gguf parses a file once (an export reads its header up to three times), and a file
    rewritten in place, even to the same size, is read again."""
    from export.gguf_loader import read_gguf

    folder = make_hf_folder(tmp_path / "hf", "llama")
    path = tmp_path / "tiny.gguf"
    write_arch_gguf(folder, path, chat_template="{{ 'AAAA' }}")
    first = read_gguf(path)
    assert read_gguf(path) is first
    size = path.stat().st_size
    write_arch_gguf(folder, path, chat_template="{{ 'BBBB' }}")
    assert path.stat().st_size == size
    assert read_gguf(path) is not first
    assert load_gguf(path).chat_template == "{{ 'BBBB' }}"
