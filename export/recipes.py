"""What MODEL means for `edgekv export`: a recipe name from models/, a Hugging Face folder or a
.gguf file; its loading, and what --weights auto resolves to for it."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from edgekv.errors import ExportError
from export.gguf_loader import gguf_matrix_types, load_gguf
from export.loaders import load_hf_folder
from export.source import Source, SourceError
from export.model_config import UnsupportedModel
from export.model_sampling import recipe_sampling
from export.weights import KEPT_BITS, auto_format

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
DEFAULT_RECIPE = "smollm2-135m-instruct"


def recipe_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def resolve_source(model: str | None) -> tuple[Source, dict]:
    """MODEL: a recipe name from models/, a Hugging Face folder, or a .gguf file."""
    path, recipe = locate_source(model)
    return load_source(path), recipe


def locate_source(model: str | None) -> tuple[Path, dict]:
    """MODEL -> (the folder or .gguf file, its recipe), without reading any weights."""
    model = model or DEFAULT_RECIPE
    recipe = {}
    if (MODELS_DIR / f"{model}.json").is_file():
        recipe = json.loads((MODELS_DIR / f"{model}.json").read_text())
        recipe_sampling({"name": model, **recipe})  # a bad recipe is refused before anything loads
        path = recipe_path(recipe)
    else:
        path = Path(model)
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        if path.exists():
            raise ExportError(f"{path}: not a model (give a Hugging Face folder, a .gguf file or a recipe: "
                              f"{', '.join(recipe_names())})")
        raise ExportError(f"{model}: no such recipe, folder or .gguf file (recipes: {', '.join(recipe_names())})")
    recipe.setdefault("name", _default_name(path))
    return path, recipe


def load_source(path: Path) -> Source:
    """The model's weights, tokenizer and config (the slow part: tens of seconds for a GGUF)."""
    try:
        return load_hf_folder(path) if path.is_dir() else load_gguf(path)
    except (SourceError, UnsupportedModel) as e:
        raise ExportError(str(e)) from None
    except (KeyError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: unreadable model config ({type(e).__name__}: {e})") from None


def source_weights(path: Path, weights: str) -> tuple[str, str]:
    """--weights resolved (auto: what the source holds, read from its header) and a phrase of why."""
    if weights != "auto":
        return weights, "as asked"
    if path.is_dir():
        return "float", "auto: a Hugging Face folder holds float weights"
    try:
        types = gguf_matrix_types(path)
    except SourceError as e:
        raise ExportError(str(e)) from None
    fmt = auto_format(types, "embed.weight", "lm_head.weight")
    held = ", ".join(sorted({t for ts in types.values() for t in ts})) or "no 2-D weights"
    if fmt == "float":
        return fmt, (f"auto: the GGUF holds {held}; only {', '.join(KEPT_BITS)} blocks are kept as they are, so its "
                     f"values are stored as float (--weights int4 or int8 requantizes)")
    return fmt, f"auto: the GGUF's own {held} blocks, kept exactly"


def recipe_path(recipe: dict) -> Path:
    src = recipe["source"]
    spec = importlib.util.find_spec(src["package"])
    if spec is None or not spec.submodule_search_locations:
        raise ExportError(f"recipe {recipe['name']}: package {src['package']} is not installed "
                          f"({src['install']})")
    return Path(list(spec.submodule_search_locations)[0]) / src["file"]


def _default_name(path: Path) -> str:
    return (path.stem if path.suffix == ".gguf" else path.name).lower().replace(".", "-")
