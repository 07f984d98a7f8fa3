"""What a loader hands the exporter (`Source`: the config, the state dict under export/model.py's
names, the tokenizer, chat template, special tokens, the model's sampling defaults), and the
helpers both loaders share: the source files' hash and the special tokens from a vocabulary."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from export.model_config import ModelConfig


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
    sampling: dict = field(default_factory=dict)  # the model's sampling defaults (export/model_sampling.py)



def file_sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()



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
