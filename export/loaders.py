"""Checkpoint loaders: a Hugging Face folder (config.json + *.safetensors + tokenizer.json) or a
GGUF file. Each returns a `Source`: the config, a state dict named for export/model.py, the
tokenizer JSON, the chat template and the special tokens. Weight names go through an explicit
table; counts and shapes are asserted against the model."""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from export.model import FAMILIES, ModelConfig, Transformer, UnsupportedModel
from export.weights import concat_rows, from_gguf_blocks, permute_rows

# checkpoint name (per layer with {i}) -> our name, or (our name, slot) for parts that are
# concatenated along dim 0 into one fused matrix (q|k|v -> wqkv, gate|up -> w_gate_up)
HF_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": ("layers.{i}.attn.wqkv.weight", 0),
    "model.layers.{i}.self_attn.k_proj.weight": ("layers.{i}.attn.wqkv.weight", 1),
    "model.layers.{i}.self_attn.v_proj.weight": ("layers.{i}.attn.wqkv.weight", 2),
    "model.layers.{i}.self_attn.q_proj.bias": ("layers.{i}.attn.wqkv.bias", 0),
    "model.layers.{i}.self_attn.k_proj.bias": ("layers.{i}.attn.wqkv.bias", 1),
    "model.layers.{i}.self_attn.v_proj.bias": ("layers.{i}.attn.wqkv.bias", 2),
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.wo.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": ("layers.{i}.mlp.w_gate_up.weight", 0),
    "model.layers.{i}.mlp.up_proj.weight": ("layers.{i}.mlp.w_gate_up.weight", 1),
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.w_down.weight",
}

GGUF_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "blk.{i}.attn_q.weight": ("layers.{i}.attn.wqkv.weight", 0),
    "blk.{i}.attn_k.weight": ("layers.{i}.attn.wqkv.weight", 1),
    "blk.{i}.attn_v.weight": ("layers.{i}.attn.wqkv.weight", 2),
    "blk.{i}.attn_q.bias": ("layers.{i}.attn.wqkv.bias", 0),
    "blk.{i}.attn_k.bias": ("layers.{i}.attn.wqkv.bias", 1),
    "blk.{i}.attn_v.bias": ("layers.{i}.attn.wqkv.bias", 2),
    "blk.{i}.attn_output.weight": "layers.{i}.attn.wo.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.mlp_norm.weight",
    "blk.{i}.ffn_gate.weight": ("layers.{i}.mlp.w_gate_up.weight", 0),
    "blk.{i}.ffn_up.weight": ("layers.{i}.mlp.w_gate_up.weight", 1),
    "blk.{i}.ffn_down.weight": "layers.{i}.mlp.w_down.weight",
}


# what an architecture's checkpoint names differently from the Llama layout above
HF_EXTRA = {
    "qwen3": {"model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attn.q_norm.weight",
              "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attn.k_norm.weight"},
    "phi3": {"model.layers.{i}.self_attn.qkv_proj.weight": "layers.{i}.attn.wqkv.weight",  # already q|k|v
             "model.layers.{i}.mlp.gate_up_proj.weight": "layers.{i}.mlp.w_gate_up.weight"},  # already gate|up
    "gemma3": {"model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attn.q_norm.weight",
               "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attn.k_norm.weight",
               # Gemma's post_attention_layernorm normalizes attention's output; the MLP's input
               # norm is pre_feedforward_layernorm
               "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.post_attn_norm.weight",
               "model.layers.{i}.pre_feedforward_layernorm.weight": "layers.{i}.mlp_norm.weight",
               "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.post_mlp_norm.weight"},
}
HF_DROP = {"phi3": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")}  # parts phi3 holds fused

GGUF_EXTRA = {
    "qwen3": {"blk.{i}.attn_q_norm.weight": "layers.{i}.attn.q_norm.weight",
              "blk.{i}.attn_k_norm.weight": "layers.{i}.attn.k_norm.weight"},
    "phi3": {"blk.{i}.attn_qkv.weight": "layers.{i}.attn.wqkv.weight",
             "blk.{i}.ffn_up.weight": "layers.{i}.mlp.w_gate_up.weight"},  # llama.cpp keeps gate|up fused as ffn_up
}
# GGUF architectures read, and which ones llama.cpp's convert stored with q/k rows permuted
# (its LlamaModel and subclasses interleave the rotary halves; the others keep HF's order)
GGUF_ARCHS = {"llama": True, "smollm3": True, "qwen2": False, "qwen3": False, "phi3": False}
# tensors that are RoPE parameters, not weights: read into the config
GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def hf_names(arch: str) -> dict:
    table = {k: v for k, v in HF_NAMES.items() if not any(f".{p}." in k for p in HF_DROP.get(arch, ()))}
    return {**table, **HF_EXTRA.get(arch, {})}


def gguf_names(arch: str) -> dict:
    table = dict(GGUF_NAMES)
    if arch == "phi3":
        table = {k: v for k, v in table.items() if not isinstance(v, tuple)}
    return {**table, **GGUF_EXTRA.get(arch, {})}


def offset_norms(sd: dict[str, torch.Tensor], cfg: ModelConfig, sign: float = 1.0) -> dict[str, torch.Tensor]:
    """Gemma stores RMSNorm weights as w for (1 + w): ours hold 1 + w (as llama.cpp's GGUF does),
    so the graph's norm is the same Mul for every architecture (and AWQ's folds stay valid)."""
    offset = FAMILIES[cfg.arch].get("norm_offset", 0.0)
    if not offset:
        return sd
    return {k: v + sign * offset if k.endswith("norm.weight") else v for k, v in sd.items()}


class SourceError(ValueError):
    pass


@dataclass
class Source:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer_json: str
    chat_template: str | None
    special: dict = field(default_factory=dict)  # bos_token_id, eos_token_id, stop_token_ids
    path: str = ""
    sha256: str = ""
    kind: str = ""  # "hf" | "gguf"
    blocks: dict = field(default_factory=dict)  # our name -> QuantWeight: the source's own quantized blocks (GGUF)


def _expand(table: dict, n_layers: int) -> dict:
    out = {}
    for src, dst in table.items():
        if "{i}" in src:
            for i in range(n_layers):
                out[src.format(i=i)] = (dst[0].format(i=i), dst[1]) if isinstance(dst, tuple) else dst.format(i=i)
        else:
            out[src] = dst
    return out


def rename(weights: dict[str, torch.Tensor], table: dict[str, str], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map checkpoint names to ours; refuse unknown or missing tensors and wrong shapes."""
    names = _expand(table, cfg.n_layers)
    unknown = [k for k in weights if k not in names and not k.endswith("rotary_emb.inv_freq")]
    if unknown:
        raise SourceError(f"unexpected tensors in checkpoint: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    sd, parts = {}, {}
    for k, v in weights.items():
        if k not in names:
            continue
        dst = names[k]
        if isinstance(dst, tuple):
            parts.setdefault(dst[0], {})[dst[1]] = v
        else:
            sd[dst] = v
    for dst, slots in parts.items():
        if sorted(slots) != list(range(len(slots))) or len(slots) not in (2, 3):
            raise SourceError(f"checkpoint has only parts {sorted(slots)} of {dst}")
        sd[dst] = torch.cat([slots[j] for j in sorted(slots)], 0)
    expected = _expected_shapes(cfg)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    missing = [k for k in expected if k not in sd]
    if missing:
        raise SourceError(f"checkpoint lacks tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for k, shape in expected.items():
        if tuple(sd[k].shape) != shape:
            raise SourceError(f"tensor {k}: shape {tuple(sd[k].shape)}, config says {shape}")
    assert len(sd) == len(expected), (len(sd), len(expected))
    return sd


def rename_blocks(blocks: dict, table: dict, cfg: ModelConfig) -> dict:
    """The source's quantized blocks under our names; a fused matrix keeps its blocks only if
    every part has them in the same format."""
    names = _expand(table, cfg.n_layers)
    out, parts = {}, {}
    for k, q in blocks.items():
        dst = names.get(k)
        if isinstance(dst, tuple):
            parts.setdefault(dst[0], {})[dst[1]] = q
        elif dst is not None:
            out[dst] = q
    for dst, slots in parts.items():
        n_parts = 3 if dst.endswith("wqkv.weight") else 2
        if sorted(slots) == list(range(n_parts)):
            try:
                out[dst] = concat_rows([slots[j] for j in range(n_parts)])
            except ValueError:
                pass
    return out


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    with torch.device("meta"):
        m = Transformer(cfg)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()
            if not (cfg.tie_word_embeddings and k == "lm_head.weight")}


def unfuse(sd: dict[str, torch.Tensor], cfg: ModelConfig, table: dict | None = None) -> dict[str, torch.Tensor]:
    """Our state dict back to checkpoint names (fused matrices split again; table: the
    architecture's Hugging Face names by default)."""
    if table is None:
        table = hf_names(cfg.arch)
        sd = offset_norms(sd, cfg, -1.0)
    sizes = {"wqkv": [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim],
             "w_gate_up": [cfg.intermediate_size, cfg.intermediate_size]}
    out = {}
    for src, dst in _expand(table, cfg.n_layers).items():
        if isinstance(dst, tuple):
            name, slot = dst
            if name not in sd:
                continue
            key = name.split(".")[-2]
            out[src] = torch.split(sd[name], sizes[key], 0)[slot]
        elif dst in sd:
            out[src] = sd[dst]
    return out


def file_sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


# --- Hugging Face folder -------------------------------------------------------------------

def load_hf_folder(folder: str | Path) -> Source:
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise SourceError(f"{folder}: not a model folder (no config.json)")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{folder}: no *.safetensors weights (only safetensors checkpoints are read)")
    tok = folder / "tokenizer.json"
    if not tok.is_file():
        raise SourceError(f"{folder}: no tokenizer.json")
    raw_cfg = json.loads(cfg_path.read_text())
    cfg = ModelConfig.from_hf_dict(raw_cfg)
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    sd = offset_norms(rename({k: v.float() for k, v in weights.items()}, hf_names(cfg.arch), cfg), cfg)

    tcfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.is_file() else {}
    template = tcfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    tok_json = tok.read_text()
    vocab = _token_ids(tok_json)
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    eos = gen.get("eos_token_id", cfg.eos_token_id)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    eos_tok = tcfg.get("eos_token")
    if isinstance(eos_tok, dict):
        eos_tok = eos_tok.get("content")
    if eos_tok in vocab and vocab[eos_tok] not in eos:
        eos.append(vocab[eos_tok])
    bos = gen.get("bos_token_id", cfg.bos_token_id)
    special = _special(vocab, bos, eos, tcfg.get("bos_token"), eos_tok)
    return Source(cfg, sd, tok_json, template, special, str(folder), file_sha256(files), "hf")


def _token_ids(tok_json: str) -> dict[str, int]:
    d = json.loads(tok_json)
    vocab = dict(d.get("model", {}).get("vocab", {}) or {})
    if isinstance(d.get("model", {}).get("vocab"), list):  # unigram: [[piece, score], ...]
        vocab = {p[0]: i for i, p in enumerate(d["model"]["vocab"])}
    for t in d.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    return vocab


def _special(vocab: dict[str, int], bos, eos: list[int], bos_tok=None, eos_tok=None) -> dict:
    inv = {i: t for t, i in vocab.items()}
    stop = list(eos)
    for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<|end_of_text|>"):
        if name in vocab and vocab[name] not in stop:
            stop.append(vocab[name])
    if isinstance(bos_tok, dict):
        bos_tok = bos_tok.get("content")
    return {
        "bos_token_id": bos,
        "bos_token": inv.get(bos, bos_tok) if bos is not None else bos_tok,
        "eos_token_id": eos[0] if eos else None,
        "eos_token": inv.get(eos[0]) if eos else eos_tok,
        "stop_token_ids": stop,
    }


# --- GGUF ----------------------------------------------------------------------------------

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
                  blocks)


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
