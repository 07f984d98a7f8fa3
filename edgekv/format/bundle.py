"""The bundle: a folder with edgekv.json (the manifest), model.onnx (+ .data), tokenizer.json.

The manifest is the only thing the runtime trusts about a bundle. It is versioned; an unknown
version is refused, not guessed at."""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from edgekv.errors import BundleError
from edgekv.format.kvschemes import KVScheme, get_scheme

# 2: key_mask is per token, [B, S, P+S], causal rule included (1 had [B, P+S] and the graph added it);
# the manifest records the stored weight format (weights.format);
# 3: a model with sliding-window (local) layers has a second mask input, local_key_mask [B, S, P+S]
# (docs/graph.md), and the manifest records them (model.local_layers, model.sliding_window). A
# version-2 bundle is a version-3 bundle without local layers: both are read, and a model without
# local layers is still written as 2 (manifest_version), so older runtimes keep reading it.
# 4: the local layers' past/present have their own length (dim `local_past`, local_key_mask
# [B, S, local_past + S]), so a runtime may keep only their window (docs/models.md, the windowed
# cache); the manifest records it (kv.local_slots, kv.global_bytes_per_token, kv.local_bytes).
# A version-3 graph may tie the two lengths together: it is run with the full past for every layer.
FORMAT_VERSION = 4
READ_VERSIONS = (2, 3, 4)
WINDOWED_VERSION = 4  # the first version whose local layers take a past of their own length


def manifest_version(local_layers) -> int:
    """The format_version a bundle is written with: 4 only where the graph has local layers."""
    return FORMAT_VERSION if local_layers else 2


def local_slots(window: int) -> int:
    """Slots a local layer keeps per sequence: a call's first token sees the W - 1 positions
    before it (q - k < W), later ones fewer, and the call's own keys come as present.*."""
    return max(1, window - 1)


def layer_of(name: str) -> int:
    """The layer index of a graph I/O name (past.3.key_scale -> 3)."""
    return int(name.split(".")[1])
WEIGHT_FORMATS = ("float", "int8", "int4")
MANIFEST = "edgekv.json"
INPUTS = ["input_ids", "position_ids", "key_mask", "logits_index"]
LOCAL_MASK = "local_key_mask"  # the local layers' mask input, only in graphs that have local layers
DTYPES = ("float32", "float16")  # a bundle's weights and compute dtype
# the manifest's parity row (parity.outputs) whose tolerance other backends are held to: decode
# logits, set by the exporter from the scheme's measured quantization noise
PARITY_LOGITS = "logits (decode)"
MAX_MANIFEST = 16 << 20  # bytes: a manifest is a few KiB (its chat template the most of it)
RACY_NS = 2 * 10**9  # a file modified less than this long ago is hashed again next time (timestamp granularity)
VERIFIED = ".edgekv-verified.json"  # `edgekv verify`'s memory of the files it hashed (not part of the bundle)


def io_names(n_layers: int, scheme: KVScheme, local: bool = False) -> dict[str, list[str]]:
    """The graph's I/O names; `local`: the model has sliding-window layers (local_key_mask)."""
    past = [n for i in range(n_layers) for n in scheme.names(i, "past")]
    present = [n for i in range(n_layers) for n in scheme.names(i, "present")]
    inputs = list(INPUTS) + ([LOCAL_MASK] if local else [])
    return {"inputs": inputs, "past": past, "present": present, "outputs": ["logits"] + present}


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
        """Stored weight format: float, int8 or int4 (docs/weights.md)."""
        return self.manifest["weights"]["format"]

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

    @property
    def windowed(self) -> bool:
        """The graph's local layers take a past of their own length (format_version >= 4): a
        cache may keep only their window (KVCache(windowed=True))."""
        return bool(self.model.get("local_layers")) and self.manifest["format_version"] >= WINDOWED_VERSION

    @property
    def local_layers(self) -> tuple[int, ...]:
        return tuple(self.model.get("local_layers") or ())

    @property
    def window(self) -> int | None:
        """The local layers' sliding window (a key is seen while q_pos - k_pos < window), or None
        when the model has no local layers."""
        return int(self.model["sliding_window"]) if self.model.get("local_layers") else None

    def graph_bytes(self) -> int:
        """model.onnx and its external weights: what a decode step reads."""
        return sum(f.stat().st_size for f in self.path.glob("model.onnx*"))

    def logits_tolerance(self, default: float = 0.05) -> float:
        """The decode-logits tolerance the exporter set for this bundle (`default` if it has none)."""
        return self.manifest.get("parity", {}).get("outputs", {}).get(PARITY_LOGITS, {}).get("tol", default)

    def kv_bytes_per_token(self) -> int:
        """Every layer's K/V of one token (the full cache's)."""
        return self._bytes_per_token(self.model["n_layers"])

    def _bytes_per_token(self, layers: int) -> int:
        m = self.model
        fb = 2 if self.dtype == "float16" else 4
        return self.scheme.bytes_per_token(layers, m["n_kv_heads"], m["head_dim"], fb)

    def windowed_kv_bytes(self) -> tuple[int, int]:
        """The windowed cache's bytes: (per token of context, the global layers'; per sequence,
        fixed, the local layers' last local_slots positions). (full, 0) for a bundle without it."""
        if not self.windowed:
            return self.kv_bytes_per_token(), 0
        n_local = len(self.local_layers)
        return (self._bytes_per_token(self.model["n_layers"] - n_local),
                self._bytes_per_token(n_local) * local_slots(self.window))


# -- the manifest's schema: one row per key (dotted path), easy to extend ---------------------------
# Limits are resource limits as much as sanity checks: nothing a bundle says may make the runtime
# allocate more than the bounds allow before the memory check (edgekv/runtime/cache.py).
@dataclass(frozen=True)
class Field:
    path: str  # "model.n_layers"
    types: tuple  # accepted JSON types (bool is never an int here)
    required: bool = True
    lo: float | None = None  # numbers: inclusive range
    hi: float | None = None
    choices: tuple | None = None
    item: type | None = None  # lists and dicts: the type of every item (dicts: of every value)


LIMITS = {"n_layers": 1024, "n_heads": 4096, "head_dim": 4096, "vocab_size": 1 << 22, "hidden_size": 1 << 17,
          "max_context": 1 << 22, "chat_template": 1 << 20}
_NUM = (int, float)
SCHEMA = (
    Field("format_version", (int,)),
    Field("name", (str,), required=False),
    Field("exporter", (dict,), required=False),
    Field("exporter.source_key", (str,), required=False),  # the slow tests' bundle reuse (tests/conftest.py)
    Field("source", (dict,)),
    Field("source.sha256", (str, type(None)), required=False),
    Field("model", (dict,)),
    Field("model.arch", (str,)),
    Field("model.vocab_size", (int,), lo=1, hi=LIMITS["vocab_size"]),
    Field("model.hidden_size", (int,), required=False, lo=1, hi=LIMITS["hidden_size"]),
    Field("model.n_layers", (int,), lo=1, hi=LIMITS["n_layers"]),
    Field("model.n_heads", (int,), lo=1, hi=LIMITS["n_heads"]),
    Field("model.n_kv_heads", (int,), lo=1, hi=LIMITS["n_heads"]),
    Field("model.head_dim", (int,), lo=1, hi=LIMITS["head_dim"]),
    Field("model.rope_theta", _NUM, required=False, lo=0),
    Field("model.local_layers", (list,), required=False, item=int),  # Gemma 3's sliding-window layers
    Field("model.sliding_window", (int, type(None)), required=False, lo=1, hi=LIMITS["max_context"]),
    Field("dtype", (str,), choices=DTYPES),
    Field("max_context", (int,), lo=1, hi=LIMITS["max_context"]),
    Field("kv", (dict,)),
    Field("kv.scheme", (str,)),
    # version 4 with local layers: the windowed cache's shape (docs/models.md)
    Field("kv.local_slots", (int,), required=False, lo=1, hi=LIMITS["max_context"]),
    Field("kv.global_bytes_per_token", (int,), required=False, lo=0),
    Field("kv.local_bytes", (int,), required=False, lo=0),
    Field("weights", (dict,)),  # docs/weights.md
    Field("weights.format", (str,), choices=WEIGHT_FORMATS),
    Field("weights.group", (int, type(None)), required=False, lo=1, hi=1 << 16),
    Field("weights.quantized_bytes", (int,), required=False, lo=0),
    Field("weights.stored", (dict,), required=False, item=dict),
    Field("weights.source_blocks_kept", (bool,), required=False),
    Field("weights.matrices", (dict,), required=False, item=dict),  # per matrix: source type, carrier, bytes
    Field("io", (dict,)),
    Field("files", (dict,)),
    Field("files.onnx", (str,)),
    Field("files.tokenizer", (str,)),
    Field("files.sizes", (dict,), required=False, item=int),
    Field("files.sha256", (dict,), required=False, item=str),
    Field("special", (dict,)),
    Field("special.stop_token_ids", (list,), required=False, item=int),
    Field("special.bos_token", (str, type(None)), required=False),
    Field("special.eos_token", (str, type(None)), required=False),
    Field("chat_template", (str, type(None)), required=False, hi=LIMITS["chat_template"]),
    Field("parity", (dict,), required=False),
)


def _lookup(man: dict, path: str):
    """(found, value) of a dotted path."""
    node = man
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def _is(value, types: tuple) -> bool:
    if isinstance(value, bool):  # JSON true/false are never numbers here
        return bool in types
    return isinstance(value, types)


def check_schema(man: dict) -> str | None:
    """What is wrong with the manifest by SCHEMA (None if nothing)."""
    for f in SCHEMA:
        found, v = _lookup(man, f.path)
        if not found:
            if f.required:
                return f"missing {f.path}"
            continue
        if not _is(v, f.types):
            return f"{f.path} is {type(v).__name__}, not {' or '.join(t.__name__ for t in f.types)}"
        if f.choices is not None and v not in f.choices:
            return f"{f.path} is {v!r}, not one of {', '.join(map(str, f.choices))}"
        if _is(v, _NUM) and not isinstance(v, bool):
            if v != v or (f.lo is not None and v < f.lo) or (f.hi is not None and v > f.hi):
                return f"{f.path} = {v} is outside {f.lo}..{f.hi if f.hi is not None else ''}"
        if isinstance(v, str) and f.hi is not None and len(v) > f.hi:
            return f"{f.path} is longer than {f.hi} characters"
        if f.item is not None:
            items = v.values() if isinstance(v, dict) else v
            if not all(_is(x, (f.item,)) for x in items):
                return f"{f.path} holds items that are not {f.item.__name__}"
    return None


def check_consistency(man: dict) -> str | None:
    """Cross-field rules the schema's rows cannot say (None if all hold)."""
    m = man["model"]
    if m["n_heads"] % m["n_kv_heads"]:
        return f"model.n_heads {m['n_heads']} is not a multiple of model.n_kv_heads {m['n_kv_heads']}"
    try:
        scheme = get_scheme(man["kv"]["scheme"])
    except ValueError as e:
        return str(e)
    local = m.get("local_layers") or []
    if any(not 0 <= i < m["n_layers"] for i in local) or len(set(local)) != len(local):
        return "model.local_layers holds a layer index twice or outside model.n_layers"
    if local and not m.get("sliding_window"):
        return "model.local_layers without a model.sliding_window"
    if local and man["format_version"] < 3:
        return "model.local_layers in a version-2 bundle (version 3 has their mask input)"
    if local and man["format_version"] >= WINDOWED_VERSION and \
            man["kv"].get("local_slots") != local_slots(m["sliding_window"]):
        return "kv.local_slots does not match model.sliding_window (version 4 records the local layers' slots)"
    if man["io"] != io_names(m["n_layers"], scheme, bool(local)):
        return "io does not match the model's layers and KV scheme"
    vocab = m["vocab_size"]
    if any(not 0 <= t < vocab for t in man["special"].get("stop_token_ids") or []):
        return f"special.stop_token_ids outside the vocabulary of {vocab}"
    sizes = man["files"].get("sizes", {})
    if any(v < 0 for v in sizes.values()):
        return "files.sizes holds a negative size"
    if any(len(h) != 64 or set(h) - set("0123456789abcdef") for h in man["files"].get("sha256", {}).values()):
        return "files.sha256 holds a value that is not a sha256"
    return None


def file_names(man: dict) -> list[str]:
    """Every file name the manifest gives (each must be inside the bundle)."""
    f = man["files"]
    return list(dict.fromkeys([f["onnx"], f["tokenizer"], *f.get("sizes", {}), *f.get("sha256", {})]))


def inside(folder: Path, name: str) -> Path | None:
    """`folder / name` if `name` is a plain relative name that stays inside `folder` (symlinks
    resolved); None otherwise."""
    if not name or name.startswith(("/", "\\")) or os.path.isabs(name) or "\x00" in name:
        return None
    parts = Path(name).parts
    if ".." in parts or not parts:
        return None
    p = folder / name
    root = os.path.realpath(folder)
    real = os.path.realpath(p)
    return p if real == root or real.startswith(root + os.sep) else None


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _open_weights(onnx_open):
    """onnx's opening of a tensor's external data file (onnx.external_data_helper), where it
    refuses a file of more than one hard link, done by us for reading: a bundle copied with
    `cp -al` or `rsync --link-dest` is intact. Every other refusal of onnx's stands (a path that
    leaves the folder, a symbolic link, a missing file); a file is only ever opened to be read
    (a write, onnx's save, gets onnx's own check)."""
    import stat

    def open_external_data(base_dir: str, location: str, tensor_name: str, read_only: bool) -> int:
        try:
            return onnx_open(base_dir, location, tensor_name, read_only)
        except Exception as e:
            if not read_only or "hard link" not in str(e) or inside(Path(base_dir), location) is None:
                raise
            refusal = e
        nofollow = getattr(os, "O_NOFOLLOW", 0)  # the last component: onnx refuses a symlink, so do we
        try:
            fd = os.open(os.path.join(base_dir, location), os.O_RDONLY | nofollow | getattr(os, "O_CLOEXEC", 0)
                         | getattr(os, "O_BINARY", 0))
        except OSError:
            raise refusal from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise refusal
        return fd

    open_external_data.edgekv = True
    return open_external_data


def allow_hardlinked_weights() -> bool:
    """Let onnx read the weights of a bundle whose files have other hard links (_open_weights);
    once per process. False where this onnx reads external data otherwise (then its own refusal
    stands, and the backend turns it into one line that says to copy the bundle)."""
    try:
        from onnx import external_data_helper as edh
    except ImportError:
        return False
    onnx_open = getattr(edh, "_open_external_data_fd", None)
    if onnx_open is None:
        return False
    if not getattr(onnx_open, "edgekv", False):
        edh._open_external_data_fd = _open_weights(onnx_open)
    return True


def hard_linked(folder: Path) -> list[str]:
    """The files in a bundle's folder that have other hard links too (a copy made with `cp -al`)."""
    try:
        with os.scandir(folder) as entries:
            return sorted(e.name for e in entries if e.is_file(follow_symlinks=False)
                          and e.stat(follow_symlinks=False).st_nlink > 1)
    except OSError:
        return []


def load_bundle(path: str | os.PathLike) -> Bundle:
    """Read the manifest and check everything that is cheap: the schema, the cross-field rules,
    file names inside the folder and their sizes (hashes: `verify`)."""
    path = Path(path)
    if not path.exists():
        raise BundleError(f"{path}: no such bundle (export one with `edgekv export`)")
    if not path.is_dir():
        raise BundleError(f"{path}: a bundle is a folder with {MANIFEST}, not a file")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise BundleError(f"{path}: not an edgekv bundle (no {MANIFEST})")
    if mpath.stat().st_size > MAX_MANIFEST:
        raise BundleError(f"{mpath}: corrupt manifest (larger than {MAX_MANIFEST >> 20} MiB)")
    try:
        man = json.loads(mpath.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BundleError(f"{mpath}: corrupt manifest ({str(e)[:120]})") from None
    if not isinstance(man, dict) or "format_version" not in man:
        raise BundleError(f"{mpath}: not an edgekv manifest (no format_version)")
    if isinstance(man["format_version"], bool) or man["format_version"] not in READ_VERSIONS:
        raise BundleError(f"{mpath}: bundle format_version {repr(man['format_version'])[:20]} is not supported by "
                          f"this edgekv (reads versions {', '.join(map(str, READ_VERSIONS))}); re-export the model "
                          f"with this version (edgekv export)")
    problem = check_schema(man) or check_consistency(man)
    if problem:
        raise BundleError(f"{mpath}: corrupt manifest ({problem})")
    for name in file_names(man):
        if inside(path, name) is None:
            raise BundleError(f"{mpath}: corrupt manifest (file {name[:80]!r} is not inside the bundle)")
    b = Bundle(path, man)
    for key, size in man["files"].get("sizes", {}).items():
        f = path / key
        if not f.is_file():
            raise BundleError(f"{path}: corrupt bundle ({key} is missing)")
        if f.stat().st_size != size:
            raise BundleError(f"{path}: corrupt bundle ({key} is {f.stat().st_size} bytes, manifest says {size})")
    if hard_linked(path):  # only then: onnx is not imported for a bundle that does not need it
        allow_hardlinked_weights()
    return b


def verify_files(b: Bundle, known: dict | None = None) -> tuple[int, dict]:
    """Hash every file the manifest has a sha256 for; a BundleError names the first that differs.
    `known`: name -> [stamp, sha256] from an earlier run; a file whose stamp (size, mtime, ctime,
    inode) is unchanged is not hashed again. Returns (files hashed now, the new `known`)."""
    hashes = b.manifest["files"].get("sha256")
    if not hashes:
        raise BundleError(f"{b.path}: the manifest has no sha256 per file (exported by an older edgekv); "
                          f"re-export it to be able to verify it")
    missing = set(b.manifest["files"].get("sizes", {})) - set(hashes)
    if missing:
        raise BundleError(f"{b.path}: corrupt manifest (no sha256 for {', '.join(sorted(missing))})")
    known, hashed = dict(known or {}), 0
    for name, want in sorted(hashes.items()):
        f = b.path / name
        if not f.is_file():
            raise BundleError(f"{b.path}: corrupt bundle ({name} is missing)")
        st = f.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        if known.get(name) != [stamp, want]:
            got = file_sha256(f)
            hashed += 1
            if got != want:
                known.pop(name, None)
                raise BundleError(f"{b.path}: corrupt bundle ({name} does not match its sha256: the file was "
                                  f"changed or damaged; re-export or copy the bundle again)")
            if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > RACY_NS:
                known[name] = [stamp, want]  # a file changed just now could change again within the same tick
    return hashed, known
