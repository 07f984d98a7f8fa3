"""Checkpoint loaders: a Hugging Face folder (config.json + *.safetensors + tokenizer.json) here,
a GGUF file in gguf_loader.py. Each returns a `Source` (source.py): the config, a state dict named
for export/model.py, the tokenizer JSON, the chat template, the special tokens and the model's
sampling defaults. Weight names go through an explicit table (checkpoint_names.py); counts and
shapes are asserted against the model."""
from __future__ import annotations

import json
from pathlib import Path

from export.checkpoint_names import hf_names, offset_norms, rename
from export.model_config import ModelConfig
from export.model_sampling import from_generation_config
from export.source import Source, SourceError, _special, _token_ids, file_sha256

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
    return Source(cfg, sd, tok_json, template, special, str(folder), file_sha256(files), "hf",
                  sampling=from_generation_config(gen))
