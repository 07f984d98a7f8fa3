"""Where a bundle goes (output-folder handling): --out may be nothing, an empty folder or an old
bundle (a folder with other files only with --force); the checked bundle is made in a temporary
folder beside it and put in place only when every check passed."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from edgekv.errors import ExportError, note
from edgekv.format.bundle import MANIFEST, VERIFIED
from edgekv.format.files import check_space, kind_of, make_folders, replace_dir, replace_dir_keeping, temp_dir
from export import recipes


def default_out_dir(name: str, kv: str, dtype: str, weights: str) -> Path:
    """models/bundles/NAME-KV, + -fp16 for float16, + -wFORMAT for quantized weights."""
    suffix = ("-fp16" if dtype == "float16" else "") + ("" if weights == "float" else f"-w{weights}")
    return recipes.MODELS_DIR / "bundles" / f"{name}-{kv}{suffix}"


@contextlib.contextmanager
def staging(out_dir: Path, need: int = 0):
    """A temporary folder beside out_dir (the same file system: the bundle moves in whole), removed
    afterwards whatever happened; a killed export's left there before are removed first. `need`:
    the bytes the bundle takes at least, checked against the free space before anything is
    written; a disk that fills up anyway is one line naming out_dir (edgekv/format/files.py)."""
    make_folders(out_dir.parent)
    with temp_dir(out_dir, need) as tmp:
        yield tmp


def check_room(out_dir: Path, need: int) -> None:
    """Room beside out_dir for `need` bytes (a killed export's leftovers there removed first),
    checked in the nearest folder that exists: nothing is made yet."""
    above = next(p for p in out_dir.absolute().parents if kind_of(p) is not None)
    check_space(out_dir, need, above)


def share(folder: Path) -> None:
    """mkdtemp makes 0700; a bundle is meant to be shared."""
    for f in [folder, *folder.iterdir()]:
        f.chmod(0o755 if f.is_dir() else 0o644)


def install(tmp: Path, out_dir: Path) -> None:
    """Put the checked bundle `tmp` at out_dir. Of an old bundle there only the files its manifest
    names are replaced; anything else in it stays where it is (engines/ too: an engine records the
    manifest's fingerprint, so the old graph's engines are stale and `build-engine` rebuilds them).
    A folder that is not a bundle (--force) is moved aside whole. One line says what was kept."""
    owned = bundle_files(out_dir)
    if owned is None:
        kept = replace_dir(tmp, out_dir, keep_old=not replaceable(out_dir))
        if kept:
            note(f"  (the folder's old contents are kept in {kept})")
        return
    moved, aside = replace_dir_keeping(tmp, out_dir, owned)
    if moved:
        names = ", ".join(n + ("/" if (out_dir / n).is_dir() else "") for n in moved)
        stale = " (TensorRT engines of the old graph: stale, `edgekv build-engine` rebuilds them)" \
            if "engines" in moved else ""
        note(f"  kept in {out_dir}, not part of the old bundle: {names}{stale}")
    if aside:
        note(f"  (what could not stay in place is kept in {aside})")


def bundle_files(out_dir: Path) -> set[str] | None:
    """The names an old bundle at out_dir is made of (its manifest, the files it lists and the
    verify record edgekv keeps beside them), or None if out_dir is not a bundle."""
    if kind_of(out_dir) != "a folder" or not replaceable(out_dir) or not (out_dir / MANIFEST).is_file():
        return None
    files = json.loads((out_dir / MANIFEST).read_text()).get("files")  # replaceable: a JSON object
    named = set()
    if isinstance(files, dict):
        named = {*(files.get("sizes") if isinstance(files.get("sizes"), dict) else {}),
                 files.get("onnx"), files.get("tokenizer")}
    # only plain names inside the folder: a manifest cannot make export delete anything else
    return {n for n in named if isinstance(n, str) and n not in ("", ".", "..") and Path(n).name == n} \
        | {MANIFEST, VERIFIED}


def replaceable(out_dir: Path) -> bool:
    """An empty folder or an edgekv bundle (its manifest says so): replaced without asking."""
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return True
    try:
        man = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(man, dict) and "format_version" in man


def check_out_dir(out_dir: Path, force: bool) -> None:
    """--out may be nothing, an empty folder or an old bundle; a folder with other things in it
    only with --force (and then its contents are moved aside, never deleted)."""
    kind = kind_of(out_dir)
    if kind not in (None, "a folder"):
        raise ExportError(f"{out_dir}: is {kind}; --out must be a folder (or a new name)")
    above = next(p for p in out_dir.absolute().parents if kind_of(p) is not None)  # "/" at the latest
    if not above.is_dir():
        raise ExportError(f"{out_dir}: cannot make a folder there, {above} is {kind_of(above)}")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ExportError(f"{out_dir}: cannot write in {above} (no permission)")
    if kind and not force and not replaceable(out_dir):
        raise ExportError(f"{out_dir}: a folder with other files, not an edgekv bundle; choose another --out "
                          f"(or --force: its contents are moved aside to {out_dir.name}.old-*, not deleted)")
