"""Grammars that restrict a reply (JSON Schema, any JSON object, a regex, Lark), enforced token by
token with llguidance (docs/structured.md). A grammar is compiled against the bundle's own
tokenizer (`tokenizer_for`: built once per bundle, cached); `compile_grammar` gives a
`GrammarConstraint`, the runtime's `Constraint` (constraint.py) for one reply.

Anything the grammar engine cannot enforce (a JSON Schema keyword, a format, a look-around) is a
`GrammarError` naming it, never a grammar that quietly lets it through; so is a grammar past the
limits below (a client must not stall the server with one). llguidance is the serve extra: it is
imported only when a grammar is asked for."""
from __future__ import annotations

import json
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekv.errors import EdgeKVError
from edgekv.format.bundle import Bundle
from edgekv.runtime import grammar_checks as checks

# a grammar's source (a schema's JSON text, a regex, a Lark grammar) is refused past this many
# characters: compile time grows with it (a 125 kB schema of 2000 properties took ~0.2 s here)
MAX_GRAMMAR_CHARS = 32 << 10
# JSON Schema nesting, in levels of subschemas as the schema's author sees them (a property's
# schema, an item's, an anyOf member: one level below its parent; 32 nested objects are 32 levels).
# llguidance reads the schema with serde_json, which stops at 128 levels of JSON (arrays and
# objects; a level of subschemas is one or two of them, and the grammar wraps the schema in a few
# more): past either limit below the error says so before the compiler is asked
MAX_SCHEMA_DEPTH = 50
MAX_JSON_DEPTH = 120
# a regex (a schema's pattern, --regex) that matches nothing shorter than this many characters is
# refused: llguidance's lexer spells counted repetitions out, `(a{1000}){1000}` a million characters
# (~1-2 s, then "too many expressions constructed"); 65536 take ~0.15 s here
MAX_REGEX_MIN_CHARS = 1 << 16
# whitespace the JSON grammar allows at each place JSON allows it: a space, or a newline and an
# indent (as llama.cpp's JSON grammar): a small model otherwise can emit newlines until max tokens
JSON_WHITESPACE = r"( |\n[ \t]{0,20})"
# options that must hold whatever a schema's own "x-guidance" says: an unimplemented keyword is an
# error (lenient would ignore it), oneOf is not approximated by anyOf
JSON_OVERRIDES = {"lenient": False, "coerce_one_of": False}


class GrammarError(EdgeKVError):
    """A grammar that cannot be enforced as asked: too large, malformed, or a feature the engine
    lacks (an HTTP 400: the message names it)."""


@dataclass(frozen=True)
class Grammar:
    kind: str  # "json_schema" | "json_object" | "regex" | "lark"
    text: str  # llguidance's grammar (its JSON form)
    # a schema's regexes with counted repetitions: compile_grammar tries each alone (inside the
    # grammar the engine reaches one only when the reply does)
    patterns: tuple[str, ...] = ()


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarError("structured output needs llguidance: pip install -e '.[serve]'") from None
    return llguidance


def _check_size(what: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{what} is {len(text)} characters, more than the {MAX_GRAMMAR_CHARS} allowed")


def check_schema(schema, what: str = "the JSON schema") -> str:
    """The schema's JSON text, if it is a schema within the limits (GrammarError if not)."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{what} must be an object")
    levels = checks.schema_levels(schema)
    if levels > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels: its subschemas (properties, items, "
                           f"anyOf, ...) go {levels} levels deep")
    if checks.json_depth(schema, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise GrammarError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels of JSON arrays and objects (a const, "
                           f"enum or default value counts): the grammar engine reads no deeper")
    text = json.dumps(schema)
    _check_size(what, text)
    cycle = checks.ref_cycle(schema)
    if cycle:
        raise GrammarError(f"{what}: recursive $ref {' -> '.join(cycle)} is not supported: it refers back to itself "
                           "before describing any value (recursion through a property or an item is)")
    for pattern in checks.patterns(schema):
        _check_regex(f"{what}: the pattern", pattern)
    return text


def _check_regex(what: str, pattern: str) -> None:
    shortest = checks.regex_min_chars(pattern)
    if shortest > MAX_REGEX_MIN_CHARS:
        at_least = f"{shortest}" if shortest < checks.BIG else "astronomically many"
        raise GrammarError(f"{what} {pattern[:80]!r} matches nothing shorter than {at_least} characters (counted "
                           f"repetitions multiply out); the grammar engine builds at most {MAX_REGEX_MIN_CHARS}")


def json_schema(schema) -> Grammar:
    """A reply that validates against `schema` (a JSON Schema: an object, or true/false)."""
    text = check_schema(schema)
    llg = _llguidance()
    try:
        g = llg.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_pattern": JSON_WHITESPACE},
                                                   overrides=JSON_OVERRIDES)
    except ValueError as e:
        raise GrammarError(f"JSON schema: {_first_line(e)}") from None
    return Grammar("json_schema", g, counted_patterns(schema))


def counted_patterns(schema) -> tuple[str, ...]:
    """The schema's regexes that hold a counted repetition (what can outgrow the lexer's limits)."""
    return tuple(dict.fromkeys(p for p in checks.patterns(schema) if checks.COUNTED.search(p)))


def json_object() -> Grammar:
    """Any JSON object (OpenAI's response_format json_object)."""
    return Grammar("json_object", json_schema({"type": "object"}).text)


def regex(pattern: str) -> Grammar:
    """A reply that the whole regex matches (Rust regex syntax: no look-arounds, no backreferences)."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError("a regex must be a non-empty string")
    _check_size("the regex", pattern)
    _check_regex("the regex", pattern)
    return Grammar("regex", _llguidance().LLMatcher.grammar_from_regex(pattern))


def lark(text: str, patterns: tuple[str, ...] = ()) -> Grammar:
    """A reply in the language of a Lark grammar (llguidance's dialect: `start:` rule, %json, <special>)."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("a Lark grammar must be non-empty text")
    _check_size("the Lark grammar", text)
    return Grammar("lark", _llguidance().LLMatcher.grammar_from_lark(text), patterns)


def _first_line(e) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


# -- the tokenizer -------------------------------------------------------------------------------

@dataclass
class GrammarTokenizer:
    """llguidance's view of a bundle's tokenizer: its vocabulary (the model's logits width) and
    the bundle's stop ids, every one of them an end the grammar allows (llguidance takes a list;
    one EOS only was guidance-ai/llguidance#253)."""
    ll: object  # llguidance.LLTokenizer
    vocab_size: int
    stop_ids: tuple[int, ...]
    build_s: float  # seconds the build took (once per bundle)


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
    llg = _llguidance()
    t0 = time.perf_counter()
    try:  # the JSON text, not a path: a string that is no file is never looked up as a hub name
        ll = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(stop_ids))
    except (ValueError, RuntimeError) as e:
        raise GrammarError(f"the bundle's tokenizer cannot drive a grammar: {_first_line(e)}") from None
    return GrammarTokenizer(ll, vocab_size, stop_ids, time.perf_counter() - t0)


# -- the constraint ------------------------------------------------------------------------------

def parser_limits():
    """llguidance's per-grammar limits (its defaults, spelled out so they are ours): the fuel
    bounds each mask's work (~14 ms at most here), max_grammar_size the compiled grammar;
    short errors (no grammar dump back to the client)."""
    return _llguidance().LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000,
                                        step_lexer_fuel=200_000, step_max_items=50_000,
                                        max_lexer_states=250_000, max_grammar_size=500_000,
                                        verbose_errors=False)


def compile_grammar(tok: GrammarTokenizer, grammar: Grammar) -> "GrammarConstraint":
    """A fresh constraint for one reply; GrammarError if the grammar cannot be enforced."""
    llg = _llguidance()
    m = llg.LLMatcher(tok.ll, grammar.text, log_level=0, limits=parser_limits())
    if m.is_error():
        raise GrammarError(f"{grammar.kind.replace('_', ' ')}: {_engine_message(m.get_error())}")
    warnings = m.get_grammar_warnings()
    if warnings:  # a warning is something the engine would not enforce as written
        raise GrammarError(f"{grammar.kind.replace('_', ' ')}: {_engine_message(warnings[0])}")
    what = grammar.kind.replace('_', ' ')
    said = _first_step(m, tok)
    if said:
        raise GrammarError(f"{what}: {said}")
    for pattern in grammar.patterns:
        said = _pattern_alone(tok, pattern)
        if said:
            raise GrammarError(f"{what}: the pattern {pattern[:80]!r}: {said}")
    return GrammarConstraint(m, tok)


def _pattern_alone(tok: GrammarTokenizer, pattern: str) -> str | None:
    """_first_step of a schema's regex as a grammar of its own (one it cannot read as such is
    left to the schema's compile, which read it already)."""
    llg = _llguidance()
    try:
        alone = llg.LLMatcher(tok.ll, llg.LLMatcher.grammar_from_regex(pattern), log_level=0, limits=parser_limits())
    except ValueError:
        return None
    return None if alone.is_error() else _first_step(alone, tok)


def _first_step(m, tok: GrammarTokenizer) -> str | None:
    """What goes wrong in the grammar's first mask and first token, tried on a copy of the matcher
    (`m` stays at its start), or None: what the engine finds only once it runs (a rule that never
    ends, a lexer past its limits) is a GrammarError before a request is queued, not a failed reply."""
    probe = GrammarConstraint(m.deep_copy(), tok)
    try:
        ok = probe.allowed().copy()
    except GrammarError as e:
        return str(e).removeprefix("grammar: ")
    ok[[t for t in tok.stop_ids if t < ok.shape[0]]] = False
    if ok.any() and not probe.m.consume_token(int(np.argmax(ok))):
        return _engine_message(probe.m.get_error())
    return None


def _engine_message(msg: str) -> str:
    """llguidance's error, on one line (a regex error spans several: its last line says what)."""
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    if not lines:
        return "the grammar engine refused it"
    said = [ln for ln in lines if ln.startswith("error: ")]  # a regex error's line that says what
    if said:
        return f"invalid regex: {said[0].removeprefix('error: ')[:300]}"
    for known, meaning in ENGINE_ERRORS.items():
        if known in lines[0]:
            return f"{meaning} ({lines[0][:200]})"
    return lines[0][:300]


# llguidance's errors that name its internals, said as what in the grammar causes them
ENGINE_ERRORS = {
    "NoExtensionBias": "a rule of the grammar never ends: it only refers to itself (for a JSON schema: a recursive "
                       "$ref that never reaches a value is not supported)",
    "too many expressions constructed": "a regex is too large for the grammar engine (counted repetitions multiply "
                                        "out: (a{1000}){1000} is a million characters)",
}


class GrammarConstraint:
    """One reply's grammar state over llguidance's LLMatcher (the Constraint protocol).
    `allowed` is computed once per state (a second call before `accept` returns the same mask);
    `mask_s` / `masks` add up the mask time, for benchmarks and stats."""

    def __init__(self, matcher, tok: GrammarTokenizer):
        self.m, self.tok = matcher, tok
        self._bits = np.zeros((1, (tok.vocab_size + 31) // 32), np.int32)  # llguidance's bitmask [1, W]
        self._ok: np.ndarray | None = None  # the mask of the current state, once computed
        self.mask_s, self.masks = 0.0, 0

    def allowed(self) -> np.ndarray:
        if self._ok is None:
            t0 = time.perf_counter()
            row = self._bits[0]
            self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            self._raise_if_error()
            # bit i of word i // 32 (little-endian words): token i
            ok = np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self.tok.vocab_size).view(bool)
            if not ok.any():
                raise GrammarError("grammar: no token can continue the reply")
            self._ok = ok
            self.mask_s += time.perf_counter() - t0
            self.masks += 1
        return self._ok

    def accept(self, token: int) -> None:
        if self._ok is not None and not (0 <= token < self._ok.shape[0] and self._ok[token]):
            raise ValueError(f"token {token} is not one the grammar allows here")
        if not self.m.consume_token(int(token)):
            raise ValueError(f"token {token} does not continue the grammar: {_engine_message(self.m.get_error())}")
        self._ok = None

    def is_done(self) -> bool:
        """The grammar is complete and nothing may follow (only a stop token is allowed)."""
        return self.m.is_stopped() and not self.m.is_error()

    def is_accepting(self) -> bool:
        """What was accepted so far is a whole reply (a stop token may come next)."""
        return self.m.is_accepting()

    def rollback(self, n: int) -> None:
        """Take back the last n accepted tokens (a stop token counts as one)."""
        if n and not self.m.rollback(n):
            raise ValueError(f"cannot roll the grammar back {n} tokens: {_engine_message(self.m.get_error())}")
        self._ok = None

    def reset(self) -> None:
        self.m.reset()
        self._ok = None

    def fresh(self) -> "GrammarConstraint":
        """A new constraint for another reply, at the start of the grammar: llguidance's copy of
        this matcher as it was compiled (no second compile; this one must not have advanced)."""
        if self.masks or self.m.is_error():
            raise ValueError("fresh() copies a constraint that has not started its reply")
        return GrammarConstraint(self.m.deep_copy(), self.tok)

    def _raise_if_error(self) -> None:
        if self.m.is_error():  # a limit hit while computing the mask: never go on unconstrained
            raise GrammarError(f"grammar: {_engine_message(self.m.get_error())}")


def lark_json(schema: dict, what: str = "the JSON schema") -> str:
    """Lark's inline `%json {...}` for `schema`, with json_schema's whitespace and strictness
    (its "x-guidance" options, which inside a Lark grammar only the schema itself can carry)."""
    check_schema(schema, what)
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be an object")
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    options = {"whitespace_pattern": JSON_WHITESPACE, **own, **JSON_OVERRIDES}
    return "%json " + json.dumps({**schema, "x-guidance": options})


# -- the command line (generate's and chat's flags) -----------------------------------------------

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
