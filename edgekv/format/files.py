"""Writing a user's files safely: every write edgekv makes to a path the user named goes here.

A file is written to a unique temporary name in its own folder (O_EXCL: two writers of the same
file never share one), flushed to disk, then renamed over the target (os.replace), so a reader
sees the old file or the new one, never half of either. Only a regular file (or nothing) is ever
replaced: a symlink, a device, a FIFO or a folder at the target is refused with one line, checked
with lstat (a symlink is never followed)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from edgekv.errors import EdgeKVError

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def kind_of(path: str | os.PathLike) -> str | None:
    """What is at `path` (never following a symlink): None if nothing, "a file", or another kind."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a path under a file: nothing can be)
        return None
    if stat.S_ISREG(mode):
        return "a file"
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def check_writable(path: str | os.PathLike) -> Path:
    """`path` may be written: its folder exists and what is there now is nothing or a regular file."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if kind_of(parent) is None and not parent.is_dir():
        raise EdgeKVError(f"{p}: cannot write, no folder {parent}")
    if not parent.is_dir():
        raise EdgeKVError(f"{p}: cannot write, {parent} is not a folder")
    kind = kind_of(p)
    if kind not in (None, "a file"):
        raise EdgeKVError(f"{p}: is {kind}; edgekv replaces only regular files")
    return p


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", **kw):
    """A file object that becomes `path` when the block ends without an error (else nothing
    changes). An OS error (no permission, disk full) is one line."""
    p = check_writable(path)
    tmp = None
    try:  # the temporary file made inside the try: a Ctrl-C right after must not leave it behind
        fd, tmp = _create_temp(p)
        with os.fdopen(fd, mode, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        check_writable(p)  # still nothing but a regular file there (it may have changed meanwhile)
        os.replace(tmp, p)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError):
            raise EdgeKVError(f"{p}: cannot write ({e.strerror or e})") from None
        raise
    _fsync_dir(p.parent)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def write_json(path: str | os.PathLike, obj) -> None:
    """A tool's --json output: its folder made if missing, the file written like write_text."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(obj, indent=1))


def _create_temp(p: Path) -> tuple[int, str]:
    """A new file beside `p` with a unique name (O_EXCL, never through a symlink), created 0666
    less the umask as any new file is. Not mkstemp: its 0600 would need a chmod from the umask,
    and reading the umask means setting it, process-wide, while other threads create files."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = str(p.parent / f".{p.name}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {p}")


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (where the platform allows opening a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_dir(new: str | os.PathLike, target: str | os.PathLike, keep_old: bool = False) -> Path | None:
    """Put the complete folder `new` at `target` by rename. What was at `target` (nothing or a
    real folder, never a symlink) is renamed aside first, to a unique name beside it, then
    deleted, or with keep_old kept there (its path is returned)."""
    target = Path(target)
    kind = kind_of(target)
    if kind is None:
        os.rename(new, target)
        return None
    if kind != "a folder":
        raise EdgeKVError(f"{target}: is {kind}, not a folder; refusing to replace it")
    # an empty folder of a unique name: a folder may be renamed over an empty one
    try:
        aside = Path(tempfile.mkdtemp(prefix=f"{target.name}.old-", dir=target.parent))
        os.rename(target, aside)
    except OSError as e:
        raise EdgeKVError(f"{target}: cannot replace it ({e.strerror or e})") from None
    try:
        os.rename(new, target)
    except BaseException as e:
        os.rename(aside, target)  # put the old one back
        if isinstance(e, OSError):
            raise EdgeKVError(f"{target}: cannot replace it ({e.strerror or e})") from None
        raise
    if keep_old:
        return aside
    shutil.rmtree(aside, ignore_errors=True)
    return None


def replace_dir_keeping(new: str | os.PathLike, target: str | os.PathLike, owned) -> tuple[list[str], Path | None]:
    """replace_dir for a folder of which only the regular files named in `owned` are ours (an old
    bundle's files, say): those are replaced or deleted; every other entry of the old folder (a
    user's notes, an engines/ folder) is moved into the new one, where it was. An entry whose
    name the new folder has too stays in the old folder, renamed aside, as does anything left
    when a move fails. Returns (the names moved back, the old folder's path if it is kept)."""
    target = Path(target)
    aside = replace_dir(new, target, keep_old=True)
    if aside is None:
        return [], None
    moved = []
    try:
        for name in sorted(os.listdir(aside)):
            entry = aside / name
            if name in owned and kind_of(entry) == "a file":
                os.unlink(entry)  # ours, superseded by the new folder's
            elif kind_of(target / name) is None:
                os.rename(entry, target / name)  # on the same filesystem: a rename, nothing copied
                moved.append(name)
        aside.rmdir()
    except OSError:  # what is left stays in `aside`, whole
        return moved, aside
    return moved, None
