"""The model's own sampling defaults, read at export and recorded in the manifest's `sampling`
(what a request, `edgekv generate` or `edgekv chat` that sets none gets: edgekv/runtime/sampling.py's
defaults_of). From the recipe in models/ where it gives them, else from the source: a Hugging Face
folder's generation_config.json, a GGUF's general.sampling.* keys (llama.cpp's). docs/models.md."""
from __future__ import annotations

import numpy as np

from edgekv.errors import ExportError
from edgekv.runtime.sampling import SAMPLING_KEYS, check_sampling

# the source's key -> ours
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "repetition_penalty": "repeat_penalty"}
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.penalty_repeat": "repeat_penalty"}


def _ours(key: str, value) -> tuple[object, str | None]:
    """(the value as the manifest holds it, or None; why it is not taken)."""
    kind = SAMPLING_KEYS[key][0]
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        return None, "is not a number"
    if kind is int:
        v = max(0, int(value))  # llama.cpp's and transformers' top_k <= 0: off, as our 0
    else:
        v = float(value)
        if key == "temperature":
            v = max(0.0, v)  # llama.cpp's temp <= 0: greedy
    problem = check_sampling({key: v})  # "sampling.top_p = 1.5 is outside (0, 1]"
    return (None, problem.split(" is ", 1)[-1]) if problem else (v, None)


def _taken(found: dict[str, tuple[str, object]], where: str, none: str) -> dict:
    """found: our key -> (the source's key, its value). The manifest's `sampling`: the values
    that hold, and a `source` that names where they came from and what was left out."""
    out, left = {}, []
    for key, (theirs, value) in found.items():
        v, why = _ours(key, value)
        if why:
            left.append(f"{theirs} = {str(value)[:20]} {why}: ignored")
        else:
            out[key] = v
    note = f"{where} ({', '.join(f'{k} {v:g}' for k, v in out.items())})" if out else none
    return {**out, "source": note + "".join(f"; {x}" for x in left)}


def from_generation_config(gen: dict) -> dict:
    """A Hugging Face folder's generation_config.json (its parsed object; {} when it has none).
    The keys it gives are taken as written (as vLLM reads them); an explicit do_sample false is
    greedy, as transformers runs it."""
    where = "generation_config.json"
    if gen.get("do_sample") is False:
        rep = gen.get("repetition_penalty")
        found = {"temperature": ("do_sample", 0.0), **({"repeat_penalty": ("repetition_penalty", rep)}
                                                      if rep is not None else {})}
        return _taken(found, f"{where}: do_sample false, greedy", where)
    found = {ours: (theirs, gen[theirs]) for theirs, ours in HF_KEYS.items() if gen.get(theirs) is not None}
    return _taken(found, where, f"none in {where}" if gen else "no generation_config.json")


def _shortest(value):
    """A GGUF's float32 as the decimal it was written from (0.6, not 0.6000000238418579)."""
    if isinstance(value, (float, np.floating)) and float(np.float32(value)) == float(value):
        return float(str(np.float32(value)))
    return value


def from_gguf(field) -> dict:
    """A GGUF's general.sampling.* keys (`field(key)`: a key's contents, None where absent)."""
    found = {ours: (theirs, _shortest(field(theirs))) for theirs, ours in GGUF_KEYS.items() if field(theirs) is not None}
    return _taken(found, "the GGUF's general.sampling keys", "no general.sampling keys in the GGUF")


def manifest_sampling(source_sampling: dict, recipe: dict) -> dict:
    """The manifest's `sampling`: the recipe's where it has one (a person read the model card),
    else the source's own (possibly just a `source` saying there were none)."""
    given = recipe_sampling(recipe)
    if given is None:
        return dict(source_sampling) or {"source": "none recorded by the source"}
    note = f"recipe models/{recipe['name']}.json" + (f": {given['source']}" if given.get("source") else "")
    return {**{k: v for k, v in given.items() if k != "source"}, "source": note}


def recipe_sampling(recipe: dict) -> dict | None:
    """The recipe's `sampling` (None where it has none); an ExportError if it is not one a
    manifest may hold."""
    given = recipe.get("sampling")
    problem = given is not None and check_sampling(given)
    if problem:
        raise ExportError(f"recipe {recipe.get('name')}: {problem}")
    return given
