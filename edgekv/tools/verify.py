"""`edgekv verify BUNDLE`: every file of a bundle against the sha256 its export recorded.

Loading a bundle checks the manifest and the files' sizes (cheap); only hashing finds a file
changed in place (a bad copy, a damaged disk). The files hashed are remembered in the bundle
folder (format.bundle.VERIFIED: name -> size, mtime, ctime, inode and hash), so a later verify
hashes only what changed since; a folder that cannot be written is verified in full each time."""
from __future__ import annotations

import json

from edgekv.errors import EdgeKVError
from edgekv.format.bundle import VERIFIED, load_bundle, verify_files
from edgekv.format.files import write_text


def read_known(path) -> dict:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def cmd_verify(args) -> int:
    b = load_bundle(args.bundle)
    record = b.path / VERIFIED
    hashed, known = verify_files(b, {} if args.full else read_known(record))
    try:
        write_text(record, json.dumps(known, indent=1))
    except (OSError, EdgeKVError):
        pass  # a read-only bundle: verified in full next time
    total = len(b.manifest["files"]["sha256"])
    print(f"✓ {b.path}: {total} file(s) match their sha256 ({hashed} hashed now, {total - hashed} unchanged since "
          f"the last verify)")
    return 0
