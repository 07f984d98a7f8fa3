"""Calibration at export: the text (and its token ids) that static KV scales, key offsets and
AWQ's activation statistics are measured on, and the KV calibration itself (export/calibrate.py)."""
from __future__ import annotations

from edgekv.errors import ExportError, note
from export.kv_gate import WINDOW, held_out_check
from export.source import Source
from export.model import Transformer


def calibrate(model: Transformer, src: Source, kv: str, calib_text: str | None, calib_tokens: int,
              context: int = WINDOW) -> dict:
    from export.calibrate import calibrate_static, key_mean, set_key_offsets

    ids, desc = calibration_ids(src, calib_text, calib_tokens)
    note(f"  on {len(ids)} tokens of {desc[:60]}...")
    ref = Transformer.loaded(model.cfg, src.state_dict).eval()
    if model.scheme.center_keys:
        set_key_offsets(model, key_mean(ref, ids))
        return {"text": desc, "tokens": len(ids),
                "method": "key offset = mean key per (layer, KV head, channel) after RoPE"
                          + (" and the rotation" if model.scheme.rotate else "") + "; int4 levels fixed (INT4_LEVELS)"}
    record = {"text": desc, "tokens": len(ids), **calibrate_static(model, ref, ids)}
    return {**record, "held_out": held_out_check(model, ref, src.tokenizer_json, context)}


def calibration_ids(src: Source, calib_text: str | None, calib_tokens: int) -> tuple[list[int], str]:
    """The calibration text's token ids (at most calib_tokens) and what the text is."""
    from tokenizers import Tokenizer

    from export.calibrate import calibration_text

    text, desc = calibration_text(calib_text)
    ids = Tokenizer.from_str(src.tokenizer_json).encode(text, add_special_tokens=False).ids[:calib_tokens]
    if len(ids) < 64:
        raise ExportError(f"calibration text too short: {len(ids)} tokens (need at least 64)")
    return ids, desc
