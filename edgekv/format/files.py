"""Writing a user's files safely: every write edgekv makes to a path the user named goes here.

A file is written to a unique temporary name in its own folder (O_EXCL: two writers of the same
file never share one), flushed to disk, then renamed over the target (os.replace), so a reader
sees the old file or the new one, never half of either. Only a regular file (or nothing) is ever
replaced: a symlink, a device, a FIFO or a folder at the target is refused with one line, checked
with lstat (a symlink is never followed).

A full disk (ENOSPC, a quota's EDQUOT, the file size limit's EFBIG) is one line naming the path
and the bytes needed (DiskFull), the temporary removed and the target untouched; where the size is
known beforehand the free space is checked first. A writer holds an flock on its temporary
(`.NAME.<12 hex>.tmp`, or a folder `.NAME.tmp-<8>`) while it exists; the kernel drops it when the
writer dies (kill -9 included), so at the next write to that folder (sweep) a temporary of ours
that nobody holds is a leftover, removed, and one that is held is a write in progress, left."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from edgekv.errors import EdgeKVError, note

try:
    import fcntl
except ImportError:  # no flock (Windows): nothing is known to be a leftover, so nothing is removed
    fcntl = None

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


class DiskFull(EdgeKVError):
    """No room for a write: the path, the bytes it needs and what is free there, in one line."""

    def __init__(self, message: str, cause: int = errno.ENOSPC):
        super().__init__(message)
        self.cause = cause


FULL = {errno.ENOSPC: "no space left on the device", errno.EFBIG: "the file is too large"}
if hasattr(errno, "EDQUOT"):
    FULL[errno.EDQUOT] = "the disk quota is full"


def amount(n: int) -> str:
    return f"{n:,} bytes" + (f" ({n / 2**20:.1f} MiB)" if n >= 2**20 else "")


def free_bytes(folder: str | os.PathLike) -> int | None:
    """What may still be written under `folder` (root may use the blocks kept for root), or None."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def _size_limit() -> int | None:
    """The largest file this process may write (RLIMIT_FSIZE), or None if unlimited."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def disk_full(path, cause: int, need: int, folder=None) -> DiskFull:
    """The one line for a write of `need` bytes (at least) to `path` that found no room."""
    folder = Path(folder) if folder is not None else (Path(path).parent if str(Path(path).parent) else Path("."))
    free, limit = free_bytes(folder), _size_limit()
    with contextlib.suppress(OSError, AttributeError):
        need = max(need, os.statvfs(folder).f_frsize)  # anything written takes a block
    if cause == errno.EFBIG:
        where = f"the file size limit (ulimit -f) is {amount(limit)}" if limit is not None \
            else "more than the file system takes in one file"
    elif cause == errno.ENOSPC and free is not None:
        where = f"{amount(free)} free in {folder}"
    else:
        where = f"in {folder}"
    return DiskFull(f"{path}: cannot write, {FULL[cause]}: needs at least {amount(need)}; {where}", cause)


def full_errno(e: BaseException | None) -> int | None:
    """The disk-full errno among the exceptions that led to `e` (a library may raise its own error
    while it cleans up after the OSError: zipfile's close after a failed write), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL:
            return e.errno
        if isinstance(e, DiskFull):
            return e.cause
        e = e.__cause__ or e.__context__
    return None


def check_space(path, need: int, folder=None) -> None:
    """Room for `need` bytes at `path` (in `folder`, its parent by default), checked before
    writing; leftovers of killed writes there are removed first (they may be what fills it)."""
    folder = Path(folder) if folder is not None else Path(path).parent
    sweep(folder)
    free, limit = free_bytes(folder), _size_limit()
    if free is not None and need > free:
        raise disk_full(path, errno.ENOSPC, need, folder)
    if limit is not None and need > limit:
        raise disk_full(path, errno.EFBIG, need, folder)


def make_folders(folder: str | os.PathLike) -> None:
    """mkdir -p, a failure (a full disk included) one line."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno in FULL:
            raise disk_full(folder, e.errno, 0) from None
        raise EdgeKVError(f"{folder}: cannot make the folder ({e.strerror or e})") from None


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", size: int | None = None, **kw):
    """A file object that becomes `path` when the block ends without an error (else nothing
    changes). `size`: the bytes it will hold, if known (the free space is checked first). An OS
    error (no permission, disk full) is one line."""
    p = check_writable(path)
    check_space(p, size or 0)
    tmp = lock = None
    try:  # the temporary file made inside the try: a Ctrl-C right after must not leave it behind
        fd, tmp, lock = _create_temp(p)
        with os.fdopen(fd, mode, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        check_writable(p)  # still nothing but a regular file there (it may have changed meanwhile)
        os.replace(tmp, p)
    except BaseException as e:
        written = 0
        if tmp is not None:
            with contextlib.suppress(OSError):
                written = os.lstat(tmp).st_size
                os.unlink(tmp)
        if isinstance(e, Exception) and (cause := full_errno(e)):  # a Ctrl-C stays one
            raise disk_full(p, cause, max(size or 0, written)) from None
        if isinstance(e, OSError):
            raise EdgeKVError(f"{p}: cannot write ({e.strerror or e})") from None
        raise
    finally:
        if lock is not None:
            os.close(lock)  # held until the temporary is renamed or removed
    _fsync_dir(p.parent)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb", size=len(data)) as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    data = text.encode("utf-8")
    with atomic_open(path, "wb", size=len(data)) as f:
        f.write(data)


def write_json(path: str | os.PathLike, obj) -> None:
    """A tool's --json output: its folder made if missing, the file written like write_text."""
    make_folders(Path(path).parent)
    write_text(path, json.dumps(obj, indent=1))


def _create_temp(p: Path) -> tuple[int, str, int | None]:
    """A new file beside `p` with a unique name (O_EXCL, never through a symlink), created 0666
    less the umask as any new file is, and locked (the lock's own descriptor is returned: it
    outlives the file object). Not mkstemp: its 0600 would need a chmod from the umask, and
    reading the umask means setting it, process-wide, while other threads create files."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = str(p.parent / f".{p.name}.{os.urandom(6).hex()}.tmp")
        fd = lock = None
        try:  # a Ctrl-C at any line here leaves nothing behind
            fd = os.open(tmp, flags, 0o666)
            lock = _hold(fd, tmp)
            if lock is not False:
                return fd, tmp, lock
        except FileExistsError:
            continue
        except BaseException:
            for f in (fd, lock):
                if f:
                    os.close(f)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)  # a sweep took it between the open and the lock: another name
    raise FileExistsError(f"no free temporary name beside {p}")


def _hold(fd: int, path: str):
    """Lock what `fd` opened and check that `path` is still it: a duplicate descriptor holding
    the lock, None where there is no flock, False if a sweep got there first."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a file system without flock: written unlocked (a sweep leaves what it cannot lock)
        return None
    try:
        here, st = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    if (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino):
        return False
    return os.dup(fd)


# what edgekv's temporaries are called (and nothing else is removed): atomic_open's files, temp_dir's folders
TEMP_FILE = re.compile(r"\..+\.[0-9a-f]{12}\.tmp")
TEMP_DIR = re.compile(r"\..+\.tmp-[a-z0-9_]{8}")


def sweep(folder: str | os.PathLike) -> list[str]:
    """Remove from `folder` the temporaries of edgekv writers that died mid-write (kill -9, a
    power cut): only its own names, only a regular file (or for a folder, a real folder) this user
    owns, that no writer holds locked; one line says what was removed, one names a leftover left
    (another user's, say). Returns the names removed."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    removed, left = [], []
    for name in names:
        is_dir = bool(TEMP_DIR.fullmatch(name))
        if not is_dir and not TEMP_FILE.fullmatch(name):
            continue
        why = _remove_leftover(os.path.join(folder, name), is_dir)
        if why is None:
            removed.append(name + "/" * is_dir)
        elif why:
            left.append(f"{name} ({why})")
    if removed:
        note(f"removed {len(removed)} leftover(s) of interrupted edgekv writes in {folder}: "
             + ", ".join(removed))
    if left:
        note(f"left in {folder}, not removed: " + ", ".join(left))
    return removed


def _remove_leftover(path: str, is_dir: bool) -> str | None:
    """None once removed; "" for what is not a leftover (a write in progress, not of our kind);
    else why it stays."""
    try:
        st = os.lstat(path)
    except OSError:
        return ""
    if not (stat.S_ISDIR if is_dir else stat.S_ISREG)(st.st_mode):
        return ""  # a symlink or anything else: edgekv never makes one by that name
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        return "another user's"
    if not is_dir and st.st_nlink != 1:
        return "it has other hard links"
    if fcntl is None:
        return "no file locks here to tell a leftover from a write in progress"
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) \
        | (getattr(os, "O_DIRECTORY", 0) if is_dir else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return ""
    try:
        here = os.fstat(fd)
        if (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino):
            return ""  # replaced meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return ""  # a writer holds it: in progress
        except OSError:
            return "no file locks here to tell a leftover from a write in progress"
        try:
            return _empty_dir(fd, path) if is_dir else os.unlink(path)
        except OSError as e:
            return f"cannot remove it: {e.strerror or e}"
    finally:
        os.close(fd)


def _empty_dir(fd: int, path: str) -> str | None:
    """Remove a leftover folder (open as `fd`) if it holds only regular files of this user, as
    edgekv's temporary folders do; else say why it stays (nothing is removed then)."""
    names = os.listdir(fd)
    for name in names:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return "it holds what edgekv does not write there"
    for name in names:
        os.unlink(name, dir_fd=fd)
    os.rmdir(path)
    return None


@contextlib.contextmanager
def temp_dir(beside: str | os.PathLike, need: int = 0):
    """A new folder `.NAME.tmp-XXXXXXXX` beside `beside` (on its file system: what is made there
    moves in by rename), locked while it exists and removed afterwards whatever happened. `need`:
    the bytes it will hold at least (checked first). A full disk inside the block is one line
    naming `beside`, with `need` or what the folder held by then."""
    beside = Path(beside)
    parent = beside.parent if str(beside.parent) else Path(".")
    check_space(beside, need, parent)
    path = lock = None
    try:
        path, lock = _locked_dir(beside, parent)
        yield Path(path)
    except BaseException as e:
        cause = full_errno(e) if isinstance(e, Exception) else None
        if cause is not None:
            raise disk_full(beside, cause, max(need, _tree_bytes(path) if path else 0), parent) from None
        if isinstance(e, OSError) and path is None:
            raise EdgeKVError(f"{beside}: cannot make a folder in {parent} ({e.strerror or e})") from None
        raise
    finally:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def _locked_dir(beside: Path, parent: Path) -> tuple[str, int | None]:
    for _ in range(100):
        path = tempfile.mkdtemp(prefix=f".{beside.name}.tmp-", dir=parent)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            lock = _hold(fd, path)
        finally:
            os.close(fd)  # the lock lives on in its duplicate
        if lock is not False:
            return path, lock
    raise FileExistsError(f"no free temporary name beside {beside}")


def _tree_bytes(folder) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, n)).st_size
    return total


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
