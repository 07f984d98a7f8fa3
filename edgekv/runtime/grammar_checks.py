"""What a grammar asks of the engine, measured before llguidance is asked (runtime/grammar_build.py
refuses past its limits): how deep a JSON Schema nests its subschemas, as its author wrote them;
a `$ref` cycle that never reaches a value; the fewest characters a regex can match, where counted
repetitions multiply out (`(a{1000}){1000}`: a million, which llguidance's lexer spells out).
Pure functions over the parsed schema or the pattern's text, iterative (no recursion limit)."""
from __future__ import annotations

import re
from urllib.parse import unquote

# keywords whose value holds subschemas: a map of them, a list of them, or one
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")  # items: a list in draft 4's tuple form
SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties")


def subschemas(schema):
    """(subschema, level) of every schema within `schema`: itself at level 0, the value of a
    property, an item, an anyOf member (any keyword above) one level below its parent."""
    stack = [(schema, 0)]
    while stack:
        s, level = stack.pop()
        yield s, level
        if not isinstance(s, dict):
            continue
        for key, v in s.items():
            if key in SCHEMA_MAPS and isinstance(v, dict):
                stack.extend((c, level + 1) for c in v.values() if isinstance(c, (dict, bool)))
            elif key in SCHEMA_LISTS and isinstance(v, list):
                stack.extend((c, level + 1) for c in v if isinstance(c, (dict, bool)))
            elif key in SCHEMA_ONE and isinstance(v, (dict, bool)):
                stack.append((v, level + 1))


def schema_levels(schema) -> int:
    """How deep the schema nests subschemas: 32 objects each the property of the last is 32."""
    return max(level for _, level in subschemas(schema))


def json_depth(x, limit: int) -> int:
    """Nesting depth of a JSON value (arrays and objects), counted only up to `limit` + 1."""
    deepest, stack = 0, [(x, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def patterns(schema) -> list[str]:
    """The regexes of a schema: its `pattern`s and the keys of its `patternProperties`."""
    found = []
    for s, _ in subschemas(schema):
        if isinstance(s, dict):
            if isinstance(s.get("pattern"), str):
                found.append(s["pattern"])
            if isinstance(s.get("patternProperties"), dict):
                found.extend(s["patternProperties"])
    return found


# -- $ref cycles -------------------------------------------------------------------------------------

def _resolve(root, ref: str):
    """The schema a local `$ref` ("#", "#/$defs/A") names within `root`; None for any other."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None  # a remote ref or an anchor name: the engine says what it makes of them
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict) else None


def _immediate(root, s: dict) -> list:
    """(schema, the $ref or None) that `s` is, whole, before any value of its own: its $ref, the
    members of its allOf, the one member of a one-member anyOf or oneOf."""
    out = []
    ref = s.get("$ref")
    if isinstance(ref, str) and (target := _resolve(root, ref)) is not None:
        out.append((target, ref))
    for key in ("allOf", "anyOf", "oneOf"):
        v = s.get(key)
        if isinstance(v, list) and (key == "allOf" or len(v) == 1):
            out.extend((c, None) for c in v if isinstance(c, dict))
    return out


def ref_cycle(schema) -> list[str] | None:
    """The $refs of a cycle through which a schema is only itself again (`{"$ref": "#"}`, or
    A -> B -> A in $defs, with nothing in between that describes a value), or None. Recursion
    through a property or an item (a tree) is no such cycle: it ends where the value does."""
    if not isinstance(schema, dict):
        return None
    state: dict[int, int] = {}  # id -> 1 on the path, 2 done
    for start, _ in subschemas(schema):
        if not isinstance(start, dict) or id(start) in state:
            continue
        path, refs, stack = [start], [], [iter(_immediate(schema, start))]
        state[id(start)] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[id(path.pop())] = 2
                stack.pop()
                if refs:
                    refs.pop()
                continue
            target, ref = nxt
            seen = state.get(id(target))
            if seen == 1:  # back on the path: a cycle
                at = next(i for i, p in enumerate(path) if p is target)
                chain = [r for r in refs[at:] + [ref] if r is not None]
                return chain + chain[:1]
            if seen is None:
                state[id(target)] = 1
                path.append(target)
                refs.append(ref)
                stack.append(iter(_immediate(schema, target)))
    return None


# -- regexes ----------------------------------------------------------------------------------------

COUNTED = re.compile(r"\{(\d{1,9})(?:,(\d{0,9}))?\}")
BIG = 1 << 62  # widths are counted up to here (nested repetitions would otherwise grow without bound)


def regex_min_chars(pattern: str) -> int:
    """The fewest characters any match of `pattern` has (Rust regex syntax, as llguidance reads it:
    a character, a class, `.` or an escape is one; anchors and look-arounds none; `x{m,n}` m times
    x). An unbalanced pattern is measured as far as it goes (the engine names the error)."""
    return regex_sizes(pattern)[0]


def regex_spelled(pattern: str) -> int:
    """How many characters the pattern's counted repetitions spell out at most: `x{m,n}` is n
    copies of x (`x{m,}` m + 1), nested ones multiply, alternatives add up; a `*`, `+` or `?` is
    a loop, one copy. llguidance's lexer builds expressions in proportion (its derivatives of
    `([a-z]{1,500}){1,500}` are 250000 ways to be part-way through)."""
    return regex_sizes(pattern)[1]


def regex_sizes(pattern: str) -> tuple[int, int]:
    """(regex_min_chars, regex_spelled) in one pass."""
    # per open group: its alternatives done [(min, spelled)], this one's (min, spelled), its last
    # atom's (min, spelled), zero-width (a look-around)
    frames = [[[], [0, 0], (0, 0), False]]
    i, n = 0, len(pattern)
    while i < n:
        c, f = pattern[i], frames[-1]
        if c == "(":
            i, kind = _group_open(pattern, i)
            if kind != "flags":
                frames.append([[], [0, 0], (0, 0), kind == "look"])
            continue
        if c == "|":
            f[0].append(tuple(f[1]))
            f[1], f[2] = [0, 0], (0, 0)
            i += 1
            continue
        if c in "*?+" or (c == "{" and COUNTED.match(pattern, i)):
            if c == "{":
                m = COUNTED.match(pattern, i)
                times, i = int(m.group(1)), m.end()
                copies = times if m.group(2) is None else (max(times, 1) if m.group(2) == "" else int(m.group(2)))
            else:
                times, copies, i = (1 if c == "+" else 0), 1, i + 1
            if i < n and pattern[i] in "?+":  # lazy (or possessive)
                i += 1
            atom = f[2]
            rep = (min(atom[0] * times, BIG), min(atom[1] * copies, BIG))
            f[1] = [min(f[1][k] - atom[k] + rep[k], BIG) for k in (0, 1)]
            f[2] = rep
            continue
        if c == ")":
            i += 1
            if len(frames) == 1:
                atom = (1, 1)
            else:
                atom = _group_sizes(frames.pop())
                f = frames[-1]
        elif c == "\\":
            i, w = _escape(pattern, i)
            atom = (w, w)
        elif c == "[":
            i, atom = _class_end(pattern, i), (1, 1)
        else:
            i, atom = i + 1, (0, 0) if c in "^$" else (1, 1)
        f[1] = [min(f[1][k] + atom[k], BIG) for k in (0, 1)]
        f[2] = atom
    while len(frames) > 1:
        atom = _group_sizes(frames.pop())
        frames[-1][1] = [min(frames[-1][1][k] + atom[k], BIG) for k in (0, 1)]
    alts = frames[0][0] + [tuple(frames[0][1])]
    return min(a[0] for a in alts), min(sum(a[1] for a in alts), BIG)


def _group_sizes(frame) -> tuple[int, int]:
    """A closed group's (min, spelled): its shortest alternative, all of them spelled out."""
    alts, last, _, look = frame
    alts = alts + [tuple(last)]
    if look:
        return 0, 0
    return min(a[0] for a in alts), min(sum(a[1] for a in alts), BIG)


def _group_open(p: str, i: int) -> tuple[int, str]:
    """Past a group's opening at p[i] == "(": (index, "group" | "look" | "flags": `(?i)`, no group)."""
    if not p.startswith("(?", i):
        return i + 1, "group"
    rest = p[i + 2: i + 4]
    if rest[:1] in ("=", "!") or rest in ("<=", "<!"):
        return i + 2 + (1 if rest[:1] in ("=", "!") else 2), "look"
    if rest[:1] in ("<", "'") or rest == "P<":
        close = p.find(">" if rest[:1] != "'" else "'", i + 3)
        return (close + 1 if close >= 0 else len(p)), "group"
    j = i + 2
    while j < len(p) and (p[j].isalpha() or p[j] == "-"):
        j += 1
    if j < len(p) and p[j] == ")":
        return j + 1, "flags"
    return j + 1, "group"  # (?:...) or (?flags:...)


def _escape(p: str, i: int) -> tuple[int, int]:
    """(index past the escape at p[i] == "\\", its width: 0 for an assertion, else 1)."""
    if i + 1 >= len(p):
        return len(p), 1
    d = p[i + 1]
    if d in "bBAzZ<>":
        return i + 2, 0
    if d in "pPxu" and p.startswith("{", i + 2):
        close = p.find("}", i + 3)
        return (close + 1 if close >= 0 else len(p)), 1
    return i + 2 + {"p": 1, "P": 1, "x": 2, "u": 4}.get(d, 0), 1


def _class_end(p: str, i: int) -> int:
    """Past the character class opening at p[i] == "[" (nested classes, escapes, a leading ])."""
    j = i + 1
    if p.startswith("^", j):
        j += 1
    if p.startswith("]", j):
        j += 1
    depth = 1
    while j < len(p):
        if p[j] == "\\":
            j += 2
            continue
        if p[j] == "[":
            depth += 1
        elif p[j] == "]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return len(p)


# -- the shortest reply ----------------------------------------------------------------------------

def schema_min_chars(schema, root=None, path: frozenset = frozenset()) -> int:
    """A lower bound on the characters of any JSON value valid under `schema`, written compactly
    (whitespace is optional: json_schema's grammar never requires it); BIG where none can be
    finite (false, or a required $ref back to itself). Keywords it does not read count nothing,
    so the bound stays a bound (a number's digits, a format's length: one character)."""
    root = schema if root is None else root
    if schema is True or schema == {}:
        return 1
    if not isinstance(schema, dict):
        return BIG if schema is False else 1
    if id(schema) in path:  # back on the way here: no finite value goes round
        return BIG
    path = path | {id(schema)}
    if "const" in schema:
        return len(_compact(schema["const"]))
    if isinstance(schema.get("enum"), list):
        return min((len(_compact(v)) for v in schema["enum"]), default=BIG)
    least = _typed_min(schema, root, path)
    ref = schema.get("$ref")
    if isinstance(ref, str) and (target := _resolve(root, ref)) is not None:
        least = max(least, schema_min_chars(target, root, path))
    for member in schema.get("allOf") or []:
        least = max(least, schema_min_chars(member, root, path))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            least = max(least, min(schema_min_chars(m, root, path) for m in schema[key]))
    return min(least, BIG)


def _compact(value) -> str:
    import json
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _typed_min(s: dict, root, path) -> int:
    types = s.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) and types else None
    if types is None:
        return 1  # any value: a digit
    return min(_type_min(t, s, root, path) for t in types)


def _type_min(t: str, s: dict, root, path) -> int:
    if t == "string":
        inner = s.get("minLength") if type(s.get("minLength")) is int else 0
        if isinstance(s.get("pattern"), str):
            inner = max(inner, regex_min_chars(s["pattern"]))
        return 2 + inner
    if t in ("boolean", "null"):
        return 4  # true, null (false: 5)
    if t == "array":
        n = s.get("minItems") if type(s.get("minItems")) is int else 0
        prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
        items = s.get("items", True)
        sizes = [schema_min_chars(prefix[i] if i < len(prefix) else items, root, path) for i in range(min(n, 10_000))]
        return min(2 + sum(sizes) + max(n - 1, 0), BIG)
    if t == "object":
        req = [k for k in (s.get("required") or []) if isinstance(k, str)]
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        extra = s.get("additionalProperties", True)
        sizes = [len(_compact(k)) + 1 + schema_min_chars(props.get(k, extra), root, path) for k in req]
        return min(2 + sum(sizes) + max(len(req) - 1, 0), BIG)
    return 1  # integer, number
