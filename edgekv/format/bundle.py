"""The bundle: a folder with edgekv.json (the manifest), model.onnx (+ .data), tokenizer.json.

The manifest is the only thing the runtime trusts about a bundle. It is versioned; an unknown
version is refused, not guessed at."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from edgekv.errors import BundleError
from edgekv.format.kvschemes import KVScheme, get_scheme

FORMAT_VERSION = 2  # 2: the manifest records the stored weight format ("weights"); 1 = float weights
READABLE_VERSIONS = (1, 2)
WEIGHT_FORMATS = ("float", "int8", "int4")
MANIFEST = "edgekv.json"
INPUTS = ["input_ids", "position_ids", "key_mask", "logits_index"]
DTYPES = ("float32", "float16")  # a bundle's weights and compute dtype
# the manifest's parity row (parity.outputs) whose tolerance other backends are held to: decode
# logits, set by the exporter from the scheme's measured quantization noise
PARITY_LOGITS = "logits (decode)"


def io_names(n_layers: int, scheme: KVScheme) -> dict[str, list[str]]:
    past = [n for i in range(n_layers) for n in scheme.names(i, "past")]
    present = [n for i in range(n_layers) for n in scheme.names(i, "present")]
    return {"inputs": list(INPUTS), "past": past, "present": present, "outputs": ["logits"] + present}


@dataclass
class Bundle:
    path: Path
    manifest: dict

    @property
    def model(self) -> dict:
        return self.manifest["model"]

    @property
    def scheme(self) -> KVScheme:
        return get_scheme(self.manifest["kv"]["scheme"])

    @property
    def weights(self) -> str:
        """Stored weight format: float, int8 or int4 (docs/weights.md); version-1 bundles are float."""
        return self.manifest.get("weights", {}).get("format", "float")

    @property
    def dtype(self) -> str:
        return self.manifest["dtype"]

    @property
    def max_context(self) -> int:
        return int(self.manifest["max_context"])

    @property
    def onnx_path(self) -> Path:
        return self.path / self.manifest["files"]["onnx"]

    @property
    def tokenizer_path(self) -> Path:
        return self.path / self.manifest["files"]["tokenizer"]

    @property
    def special(self) -> dict:
        return self.manifest["special"]

    @property
    def chat_template(self) -> str | None:
        return self.manifest.get("chat_template")

    def graph_bytes(self) -> int:
        """model.onnx and its external weights: what a decode step reads."""
        return sum(f.stat().st_size for f in self.path.glob("model.onnx*"))

    def logits_tolerance(self, default: float = 0.05) -> float:
        """The decode-logits tolerance the exporter set for this bundle (`default` if it has none)."""
        return self.manifest.get("parity", {}).get("outputs", {}).get(PARITY_LOGITS, {}).get("tol", default)

    def kv_bytes_per_token(self) -> int:
        m = self.model
        fb = 2 if self.dtype == "float16" else 4
        return self.scheme.bytes_per_token(m["n_layers"], m["n_kv_heads"], m["head_dim"], fb)


_REQUIRED = ("format_version", "model", "kv", "dtype", "max_context", "files", "special", "io")


def load_bundle(path: str | os.PathLike) -> Bundle:
    path = Path(path)
    if not path.exists():
        raise BundleError(f"{path}: no such bundle (export one with `edgekv export`)")
    if not path.is_dir():
        raise BundleError(f"{path}: a bundle is a folder with {MANIFEST}, not a file")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise BundleError(f"{path}: not an edgekv bundle (no {MANIFEST})")
    try:
        man = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{mpath}: corrupt manifest ({e})") from None
    if not isinstance(man, dict) or "format_version" not in man:
        raise BundleError(f"{mpath}: not an edgekv manifest (no format_version)")
    if man["format_version"] not in READABLE_VERSIONS:
        raise BundleError(f"{mpath}: bundle format_version {man['format_version']!r} is not supported by this "
                          f"edgekv (reads versions {', '.join(map(str, READABLE_VERSIONS))}); re-export the model "
                          "with this version")
    if man["format_version"] >= 2:
        fmt = man.get("weights", {}).get("format") if isinstance(man.get("weights"), dict) else None
        if fmt not in WEIGHT_FORMATS:
            raise BundleError(f"{mpath}: weight format {fmt!r} is not supported by this edgekv "
                              f"(reads {', '.join(WEIGHT_FORMATS)})")
    missing = [k for k in _REQUIRED if k not in man]
    if missing:
        raise BundleError(f"{mpath}: corrupt manifest (missing {', '.join(missing)})")
    try:
        get_scheme(man["kv"]["scheme"])
    except (ValueError, KeyError, TypeError) as e:
        raise BundleError(f"{mpath}: {e}") from None
    b = Bundle(path, man)
    for key, size in man["files"].get("sizes", {}).items():
        f = path / key
        if not f.is_file():
            raise BundleError(f"{path}: corrupt bundle ({key} is missing)")
        if f.stat().st_size != size:
            raise BundleError(f"{path}: corrupt bundle ({key} is {f.stat().st_size} bytes, manifest says {size})")
    return b
