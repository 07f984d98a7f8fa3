"""llguidance as edgekv uses it: the one import (the serve extra: only when a grammar is asked
for), the limits every matcher is built with, what a grammar is once written in llguidance's
form, and llguidance's errors said on one line (docs/structured.md)."""
from __future__ import annotations

from dataclasses import dataclass

from edgekv.errors import EdgeKVError

# thread CPU seconds one mask may take (llguidance's fuel bounds its own work to ~15 ms at its
# quoted rates; this is the backstop that holds whatever the grammar): a row past it ends with an
# error, the step goes on. CPU time, not wall: a loaded machine does not trip it
MASK_BUDGET_S = 0.25
# thread CPU seconds a request's grammar may take to build and probe (compile_grammar)
COMPILE_BUDGET_S = 2.0
# lexer states one matcher may build as it goes (llguidance: ~1-2 kB each; its default 250000 is
# up to 500 MB for one request). A JSON reply of the tests' schemas uses < 2000
MAX_LEXER_STATES = 50_000


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
    # a lower bound on a whole reply's characters (0: not known): one that cannot fit in a
    # request's max_tokens is refused before it starts (structured.check_fits)
    min_chars: int = 0


def llguidance():
    try:
        import llguidance as llg
    except ImportError:
        raise GrammarError("structured output needs llguidance: pip install -e '.[serve]'") from None
    return llg


def parser_limits():
    """llguidance's per-grammar limits, spelled out so they are ours: lexer fuel for the build
    and per mask (~14 ms at most at its rates), Earley items per row and per step, lexer states
    (memory), grammar size; short errors (no grammar dump back to the client)."""
    return llguidance().LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000,
                                       step_lexer_fuel=200_000, step_max_items=50_000,
                                       max_lexer_states=MAX_LEXER_STATES, max_grammar_size=500_000,
                                       verbose_errors=False)


def first_line(e) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__


def engine_message(msg: str) -> str:
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
