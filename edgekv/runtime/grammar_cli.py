"""The flags generate and chat share for a grammar (--json-schema FILE, --grammar FILE.lark,
--regex R): the file read safely and the grammar built, or one error line naming the flag and
the file, before any model loads."""
from __future__ import annotations

import json
import os
import stat

from edgekv.errors import EdgeKVError
from edgekv.runtime.grammar_build import MAX_GRAMMAR_CHARS, json_schema, lark, regex
from edgekv.runtime.grammar_engine import Grammar, GrammarError

# the flags generate and chat share, named once (errors say which flag and file they came from)
GRAMMAR_FLAGS = {"json_schema": "--json-schema", "grammar": "--grammar", "regex": "--regex"}


def grammar_from_args(args) -> Grammar | None:
    """The Grammar that --json-schema FILE, --grammar FILE.lark or --regex R ask for (None: none);
    a bad file or grammar is one error naming the flag, before any model loads."""
    if getattr(args, "json_schema", None):
        flag, path = GRAMMAR_FLAGS["json_schema"], args.json_schema
        text = read_grammar_file(path, flag)
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise EdgeKVError(f"{flag} {path}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
        return _refused_as(flag, path, json_schema, schema)
    if getattr(args, "grammar", None):
        flag = GRAMMAR_FLAGS["grammar"]
        return _refused_as(flag, args.grammar, lark, read_grammar_file(args.grammar, flag))
    if getattr(args, "regex", None) is not None:
        return _refused_as(GRAMMAR_FLAGS["regex"], None, regex, args.regex)
    return None


def _refused_as(flag: str, path, make, value):
    """make(value), a GrammarError saying which flag (and file) it came from."""
    try:
        return make(value)
    except GrammarError as e:
        raise GrammarError(f"{flag}{' ' + str(path) if path else ''}: {e}") from None


def read_grammar_file(path: str, flag: str) -> str:
    """A grammar file's text: a regular file (not a FIFO or a device: never blocks), UTF-8, at
    most MAX_GRAMMAR_CHARS characters; any other is one error line naming the flag and the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise EdgeKVError(f"{flag} {path}: no such file") from None
    except OSError as e:
        raise EdgeKVError(f"{flag} {path}: cannot open it ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise EdgeKVError(f"{flag} {path}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(4 * MAX_GRAMMAR_CHARS + 1)  # UTF-8: at most 4 bytes a character
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise EdgeKVError(f"{flag} {path}: not UTF-8 text") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise EdgeKVError(f"{flag} {path}: more than {MAX_GRAMMAR_CHARS} characters")
    if not text.strip():
        raise EdgeKVError(f"{flag} {path}: the file is empty")
    return text
