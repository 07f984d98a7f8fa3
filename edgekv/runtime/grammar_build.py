"""A request's grammar written for llguidance: JSON Schema, any JSON object, a regex, Lark, each
checked against edgekv's limits first (a client must not stall the server with one): pure
measures (grammar_checks.py), no tokenizer, no matcher (grammar_constraint.py compiles)."""
from __future__ import annotations

import json

from edgekv.runtime import grammar_checks as checks
from edgekv.runtime.grammar_engine import Grammar, GrammarError, first_line, llguidance

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
# nor one whose counted repetitions spell out more than this many characters at most
# (grammar_checks.regex_spelled): `([a-z]{1,500}){1,500}` is 250000 ways to be part-way through,
# and llguidance ran out of lexer fuel within 15 tokens of it; a{40000} within 8 (a{20000} held)
MAX_REGEX_SPELLED = 1 << 14
# whitespace the JSON grammar allows at each place JSON allows it: a space, or a newline and an
# indent (as llama.cpp's JSON grammar): a small model otherwise can emit newlines until max tokens
JSON_WHITESPACE = r"( |\n[ \t]{0,20})"
# options that must hold whatever a schema's own "x-guidance" says: an unimplemented keyword is an
# error (lenient would ignore it), oneOf is not approximated by anyOf, and whitespace stays bounded
# (llguidance matches whitespace_pattern at most once a place; its separators are regexes too)
JSON_OVERRIDES = {"lenient": False, "coerce_one_of": False, "whitespace_pattern": JSON_WHITESPACE,
                  "item_separator": ",", "key_separator": ":"}


# an integer without a bound of its own is held to the range every JSON parser keeps exactly
# (I-JSON, RFC 7493: +-(2**53 - 1), 16 digits, as llama.cpp's JSON grammar caps an integral part):
# unbounded, a small model sampling digits can run to max_tokens inside one number (issue 43)
SAFE_INTEGER = 2 ** 53 - 1
# the keywords whose values are subschemas (a dict of them, a list of them, or one); const, enum,
# default and examples hold data and are never rewritten
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def bounded_integers(schema):
    """`schema` with every integer that has no lower (upper) bound given SAFE_INTEGER's."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "integer" in kinds:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    for k in SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: bounded_integers(v) for name, v in out[k].items()}
    for k in SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [bounded_integers(v) for v in out[k]]
    for k in SCHEMA_ONES:
        if k in out:
            out[k] = bounded_integers(out[k])
    return out


def check_size(what: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{what} is {len(text)} characters, more than the {MAX_GRAMMAR_CHARS} allowed")


def check_schema(schema, what: str = "the JSON schema") -> None:
    """GrammarError unless `schema` is a schema within the limits (its size counted as its author wrote it)."""
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"{what} must be an object")
    levels = checks.schema_levels(schema)
    if levels > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels: its subschemas (properties, items, "
                           f"anyOf, ...) go {levels} levels deep")
    if checks.json_depth(schema, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise GrammarError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels of JSON arrays and objects (a const, "
                           f"enum or default value counts): the grammar engine reads no deeper")
    check_size(what, json.dumps(schema))
    cycle = checks.ref_cycle(schema)
    if cycle:
        raise GrammarError(f"{what}: recursive $ref {' -> '.join(cycle)} is not supported: it refers back to itself "
                           "before describing any value (recursion through a property or an item is)")
    for pattern in checks.patterns(schema):
        check_regex(f"{what}: the pattern", pattern)


def check_regex(what: str, pattern: str) -> None:
    shortest, spelled = checks.regex_sizes(pattern)
    if shortest > MAX_REGEX_MIN_CHARS:
        at_least = f"{shortest}" if shortest < checks.BIG else "astronomically many"
        raise GrammarError(f"{what} {pattern[:80]!r} matches nothing shorter than {at_least} characters (counted "
                           f"repetitions multiply out); the grammar engine builds at most {MAX_REGEX_MIN_CHARS}")
    if spelled > MAX_REGEX_SPELLED:
        up_to = f"{spelled}" if spelled < checks.BIG else "astronomically many"
        raise GrammarError(f"{what} {pattern[:80]!r} is too large: its counted repetitions ({{m,n}}, nested ones "
                           f"multiplied) spell out up to {up_to} characters; the grammar engine is given at most "
                           f"{MAX_REGEX_SPELLED}")


def json_schema(schema) -> Grammar:
    """A reply that validates against `schema` (a JSON Schema: an object, or true/false)."""
    check_schema(schema)
    llg = llguidance()
    try:
        g = llg.LLMatcher.grammar_from_json_schema(json.dumps(bounded_integers(schema)), overrides=JSON_OVERRIDES)
    except ValueError as e:
        raise GrammarError(f"JSON schema: {first_line(e)}") from None
    return Grammar("json_schema", g, counted_patterns(schema), checks.schema_min_chars(schema))


def counted_patterns(schema) -> tuple[str, ...]:
    """The schema's regexes that hold a counted repetition (what can outgrow the lexer's limits)."""
    return tuple(dict.fromkeys(p for p in checks.patterns(schema) if checks.COUNTED.search(p)))


def json_object() -> Grammar:
    """Any JSON object (OpenAI's response_format json_object)."""
    return Grammar("json_object", json_schema({"type": "object"}).text, min_chars=2)


def regex(pattern: str) -> Grammar:
    """A reply that the whole regex matches (Rust regex syntax: no look-arounds, no backreferences)."""
    if not isinstance(pattern, str) or not pattern:
        raise GrammarError("a regex must be a non-empty string")
    check_size("the regex", pattern)
    check_regex("the regex", pattern)
    return Grammar("regex", llguidance().LLMatcher.grammar_from_regex(pattern),
                   min_chars=checks.regex_min_chars(pattern))


def lark(text: str, patterns: tuple[str, ...] = (), min_chars: int = 0) -> Grammar:
    """A reply in the language of a Lark grammar (llguidance's dialect: `start:` rule, %json, <special>)."""
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("a Lark grammar must be non-empty text")
    check_size("the Lark grammar", text)
    return Grammar("lark", llguidance().LLMatcher.grammar_from_lark(text), patterns, min_chars)


def lark_json(schema: dict, what: str = "the JSON schema") -> str:
    """Lark's inline `%json {...}` for `schema`, with json_schema's whitespace and strictness
    (its "x-guidance" options, which inside a Lark grammar only the schema itself can carry)."""
    check_schema(schema, what)
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be an object")
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    return "%json " + json.dumps({**bounded_integers(schema), "x-guidance": {**own, **JSON_OVERRIDES}})

