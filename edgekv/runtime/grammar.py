"""Grammars that restrict a reply (JSON Schema, any JSON object, a regex, Lark), enforced token by
token with llguidance (docs/structured.md). A grammar is compiled against the bundle's own
tokenizer (`tokenizer_for`: built once per bundle, cached); `compile_grammar` gives a
`GrammarConstraint`, the runtime's `Constraint` (constraint.py) for one reply.

Anything the grammar engine cannot enforce (a JSON Schema keyword, a format, a look-around) is a
`GrammarError` naming it, never a grammar that quietly lets it through; so is a grammar past the
limits (a client must not stall the server with one). llguidance is the serve extra: it is
imported only when a grammar is asked for.

This module is the one name callers import; the work is split by concern:
    grammar_engine.py      llguidance, its limits and budgets, Grammar, GrammarError, its errors said
    grammar_checks.py      pure measures of a schema or regex (depth, $ref cycles, sizes, shortest reply)
    grammar_build.py       a request's grammar written for llguidance, within edgekv's limits
    grammar_tokenizer.py   the bundle's tokenizer as llguidance sees it (cached)
    grammar_constraint.py  compile_grammar and GrammarConstraint (the mask, its CPU budget)
    grammar_worker.py      the pool grammars are built on, off the step and the event loop
    grammar_cli.py         generate's and chat's --json-schema / --grammar / --regex"""
from __future__ import annotations

from edgekv.runtime.grammar_build import (JSON_OVERRIDES, JSON_WHITESPACE, MAX_GRAMMAR_CHARS,  # noqa: F401
                                          MAX_JSON_DEPTH, MAX_REGEX_MIN_CHARS, MAX_REGEX_SPELLED,
                                          MAX_SCHEMA_DEPTH, check_schema, counted_patterns, json_object,
                                          json_schema, lark, lark_json, regex)
from edgekv.runtime.grammar_cli import GRAMMAR_FLAGS, grammar_from_args, read_grammar_file  # noqa: F401
from edgekv.runtime.grammar_constraint import GrammarConstraint, compile_grammar  # noqa: F401
from edgekv.runtime.grammar_engine import (COMPILE_BUDGET_S, ENGINE_ERRORS, MASK_BUDGET_S,  # noqa: F401
                                           MAX_LEXER_STATES, Grammar, GrammarError, parser_limits)
from edgekv.runtime.grammar_tokenizer import GrammarTokenizer, stop_ids_of, tokenizer_for  # noqa: F401
from edgekv.runtime.grammar_worker import compile_async, compile_bounded, give_memory_back  # noqa: F401
