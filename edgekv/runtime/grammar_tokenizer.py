"""llguidance's view of a bundle's tokenizer, built once per bundle and cached (its vocabulary is
the model's logits width; every stop id of the bundle is an end a grammar allows)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from edgekv.format.bundle import Bundle
from edgekv.runtime.grammar_engine import GrammarError, first_line, llguidance


@dataclass
class GrammarTokenizer:
    """llguidance's view of a bundle's tokenizer: its vocabulary (the model's logits width) and
    the bundle's stop ids, every one of them an end the grammar allows (llguidance takes a list;
    one EOS only was guidance-ai/llguidance#253)."""
    ll: object  # llguidance.LLTokenizer
    vocab_size: int
    stop_ids: tuple[int, ...]
    build_s: float  # seconds the build took (once per bundle)
    _longest: int | None = field(default=None, repr=False)

    @property
    def max_token_bytes(self) -> int:
        """The most bytes one token decodes to (a reply of n bytes takes at least n / this tokens)."""
        if self._longest is None:
            self._longest = max(len(self.ll.decode_bytes([t])) for t in range(self.vocab_size))
        return max(self._longest, 1)


_TOKENIZERS: dict[tuple, GrammarTokenizer] = {}
_TOKENIZERS_MAX = 4
_TOKENIZERS_LOCK = threading.Lock()


def stop_ids_of(bundle: Bundle) -> tuple[int, ...]:
    """The ids a reply may end on (the bundle's stop ids, else its EOS id); a grammar needs one."""
    ids = bundle.special.get("stop_token_ids") or []
    if not ids and bundle.special.get("eos_token_id") is not None:
        ids = [bundle.special["eos_token_id"]]
    if not ids:
        raise GrammarError(f"{bundle.path}: the bundle names no stop token, so no grammar can end")
    return tuple(sorted(set(int(i) for i in ids)))


def tokenizer_for(bundle: Bundle) -> GrammarTokenizer:
    """The bundle's GrammarTokenizer, built from its tokenizer.json once (~0.3-0.6 s for 49k tokens)
    and kept for the bundle's file as it is now (its size and mtime are in the key)."""
    path = Path(bundle.tokenizer_path)
    st = path.stat()
    vocab, stops = int(bundle.model["vocab_size"]), stop_ids_of(bundle)
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, vocab, stops)
    with _TOKENIZERS_LOCK:  # one build per key, also with many request threads asking at once
        hit = _TOKENIZERS.get(key)
        if hit is None:
            hit = _build_tokenizer(path.read_text(encoding="utf-8"), vocab, stops)
            if len(_TOKENIZERS) >= _TOKENIZERS_MAX:
                _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
            _TOKENIZERS[key] = hit
        return hit


def _build_tokenizer(tokenizer_json: str, vocab_size: int, stop_ids: tuple[int, ...]) -> GrammarTokenizer:
    llg = llguidance()
    t0 = time.perf_counter()
    try:  # the JSON text, not a path: a string that is no file is never looked up as a hub name
        ll = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(stop_ids))
    except (ValueError, RuntimeError) as e:
        raise GrammarError(f"the bundle's tokenizer cannot drive a grammar: {first_line(e)}") from None
    return GrammarTokenizer(ll, vocab_size, stop_ids, time.perf_counter() - t0)
