"""A GGUF file (llama.cpp's) as a `Source`: its header's config and tokenizer, its tensors
dequantized (q/k rows unpermuted where llama.cpp's convert interleaved them) and, where they are
blocks edgekv keeps, the blocks themselves; the file's sampling keys."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from export.checkpoint_names import _expand, gguf_names, rename, rename_blocks
from export.model_config import ModelConfig, UnsupportedModel
from export.model_sampling import from_gguf
from export.source import Source, SourceError, _special, file_sha256
from export.weights import from_gguf_blocks, permute_rows

# GGUF architectures read, and which ones llama.cpp's convert stored with q/k rows permuted
# (its LlamaModel and subclasses interleave the rotary halves; the others keep HF's order)
GGUF_ARCHS = {"llama": True, "smollm3": True, "qwen2": False, "qwen3": False, "phi3": False}
# tensors that are RoPE parameters, not weights: read into the config
GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert permutation of q/k rows (it interleaves the rotary halves)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def read_gguf(path: str | Path):
    """The gguf package's reader of `path`, parsed once per version of the file: an export reads
    the header up to three times (--weights auto, the load, the manifest), and parsing it costs
    seconds (the tokenizer's ~100k strings are read one by one)."""
    p = Path(path)
    try:
        st = p.stat()
        return _gguf_reader(str(p.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    except Exception as e:  # the gguf package raises assorted errors on a bad file
        raise SourceError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


@functools.lru_cache(maxsize=1)
def _gguf_reader(path: str, inode: int, size: int, mtime_ns: int, ctime_ns: int):
    import gguf

    return gguf.GGUFReader(path)


def gguf_matrix_types(path: str | Path) -> dict[str, set[str]]:
    """Each 2-D weight under our name (q|k|v and gate|up fused) -> the GGUF types of its parts,
    from the file's header alone (no weight is dequantized): what `export --weights auto` decides
    on before anything is loaded."""
    r = read_gguf(path)
    arch = r.fields.get("general.architecture")
    layers = arch and r.fields.get(f"{arch.contents()}.block_count")
    if not layers:  # not a model load_gguf reads: it says why
        return {}
    n_layers = int(layers.contents())
    names = _expand(gguf_names(arch.contents()), n_layers)
    types: dict[str, set[str]] = {}
    for t in r.tensors:
        dst = names.get(t.name)
        if dst is not None and len(t.shape) == 2:
            types.setdefault(dst[0] if isinstance(dst, tuple) else dst, set()).add(t.tensor_type.name)
    return types


def load_gguf(path: str | Path) -> Source:
    import gguf

    path = Path(path)
    r = read_gguf(path)

    def field(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedModel(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHS)}"
                               + (" (Gemma 3's GGUF carries a SentencePiece tokenizer, which edgekv does not read: "
                                  "export its Hugging Face folder)" if arch == "gemma3" else ""))
    tok_model = field("tokenizer.ggml.model")
    if tok_model != "gpt2":
        raise UnsupportedModel(f"GGUF tokenizer {tok_model!r} is not supported (byte-level BPE 'gpt2' is); export the HF folder")
    tensors = {t.name: t for t in r.tensors}
    tokens = field("tokenizer.ggml.tokens")
    cfg = gguf_config(field, arch, tensors)
    weights, blocks = {}, {}
    for name, t in tensors.items():
        if name in GGUF_ROPE_TENSORS:
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)])  # GGUF lists dims innermost first
        q = from_gguf_blocks(t.tensor_type.name, t.data, w.shape) if w.ndim == 2 else None
        heads = {"attn_q": cfg.n_heads, "attn_k": cfg.n_kv_heads}.get(name.split(".")[-2]) if GGUF_ARCHS[arch] else None
        if heads:  # llama.cpp interleaved the rotary halves of q/k rows
            w = _unpermute(w, heads)
            q = permute_rows(q, lambda a: _unpermute(a, heads)) if q is not None else None
        weights[name] = torch.from_numpy(np.ascontiguousarray(w))
        if q is not None:
            blocks[name] = q
    sd = rename(weights, gguf_names(arch), cfg)
    blocks = rename_blocks(blocks, gguf_names(arch), cfg)

    tok_json = gguf_tokenizer_json(field, tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    special = _special(vocab, cfg.bos_token_id, cfg.eos_token_id)
    return Source(cfg, sd, tok_json, field("tokenizer.chat_template"), special, str(path), file_sha256([path]), "gguf",
                  blocks, from_gguf(field))


def gguf_config(field, arch: str, tensors: dict) -> ModelConfig:
    """The model's config from a GGUF's metadata (llama.cpp's keys, `{arch}.` prefixed) and its
    RoPE tensors (rope_freqs: Llama-3's scaling as per-frequency divisors; rope_factors_*:
    LongRoPE's two sets)."""
    def vec(name):
        t = tensors[name]
        return [float(x) for x in np.asarray(t.data, np.float32).reshape(-1)]

    n_head = field(f"{arch}.attention.head_count")
    n_embd = field(f"{arch}.embedding_length")
    n_layers = field(f"{arch}.block_count")
    head_dim = field(f"{arch}.attention.key_length", n_embd // n_head)
    ctx = field(f"{arch}.context_length", 2048)
    rotary = field(f"{arch}.rope.dimension_count", head_dim)
    scaling = field(f"{arch}.rope.scaling.type", "none")
    rope = None
    if scaling == "linear":
        rope = {"rope_type": "linear", "factor": float(field(f"{arch}.rope.scaling.factor"))}
    elif scaling not in ("none", None) and "rope_factors_long.weight" not in tensors:
        raise UnsupportedModel(f"GGUF rope scaling {scaling!r} is not supported (none, linear, llama3 rope_freqs, "
                               f"longrope factors are)")
    if "rope_factors_long.weight" in tensors:
        orig = field(f"{arch}.rope.scaling.original_context_length")
        if not orig:
            raise UnsupportedModel("GGUF with LongRoPE factors but no rope.scaling.original_context_length")
        rope = {"rope_type": "longrope", "short_factor": vec("rope_factors_short.weight"),
                "long_factor": vec("rope_factors_long.weight"), "original_max_position_embeddings": int(orig),
                "attention_factor": float(field(f"{arch}.rope.scaling.attn_factor", 1.0))}
    window = field(f"{arch}.attention.sliding_window", 0)
    if window and window < ctx:
        raise UnsupportedModel(f"{arch}: sliding-window attention (window {window}) is not supported")
    return ModelConfig(
        arch=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # the embedding's rows, padding included
        hidden_size=n_embd,
        intermediate_size=field(f"{arch}.feed_forward_length"),
        n_layers=n_layers,
        n_heads=n_head,
        n_kv_heads=field(f"{arch}.attention.head_count_kv", n_head),
        head_dim=head_dim,
        rms_norm_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        max_position_embeddings=ctx,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=[field("tokenizer.ggml.eos_token_id")],
        rope_freq_factors=vec("rope_freqs.weight") if "rope_freqs.weight" in tensors else None,
        rotary_dim=None if rotary == head_dim else rotary,
        # llama.cpp's smollm3 has no key for it: every 4th layer is NoPE (its n_no_rope_layer_step)
        nope_layers=tuple(i for i in range(n_layers) if (i + 1) % 4 == 0) if arch == "smollm3" else (),
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )


def gguf_tokenizer_json(field, tokens: list[str]) -> str:
    """Byte-level BPE tokenizer.json from GGUF metadata, for the `tokenizers` library."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    types = field("tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = field("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "default", "gpt-2", "gpt2"):
        # llama.cpp splits digits one by one for these, then the GPT-2 regex
        steps = [pre_tokenizers.Digits(individual_digits=True), byte_level] if pre != "gpt-2" else [byte_level]
    elif pre in ("qwen2", "llama-bpe", "llama3"):
        pat = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               if pre == "qwen2" else r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}")
        pat += r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        steps = [pre_tokenizers.Split(Regex(pat), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    else:
        raise UnsupportedModel(f"GGUF pre-tokenizer {pre!r} is not supported; export the HF folder")
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken
    # token_type 3 = control, 4 = user-defined: matched whole, never split by BPE
    added = [AddedToken(tokens[i], special=(types[i] == 3), normalized=False)
             for i in range(len(tokens)) if types[i] in (3, 4)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok.to_str()
