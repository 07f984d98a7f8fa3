"""The grammar of a tool-calling reply under a ToolPlan (lazy for "auto": free text until the
call's opening marker; forced for "required" or a named function; one list of calls, at most
MAX_PARALLEL_CALLS, then the reply ends), and a chat request's constraint from its
response_format or tools: checked (a 400 names what cannot be served, also a reply that could not
close within max_tokens) and compiled on the grammar workers (runtime/grammar_worker.py)."""
from __future__ import annotations

import json
import math

from edgekv.runtime.grammar_build import counted_patterns, lark, lark_json
from edgekv.runtime.grammar_engine import Grammar, GrammarError
from edgekv.runtime.grammar_tokenizer import GrammarTokenizer
from edgekv.runtime import grammar_checks as checks
from edgekv.serve.api import bad_request
from edgekv.serve.structured import compile_for_request, compile_for_request_async, response_format_grammar
from edgekv.serve.tool_constraint import RepeatStops
from edgekv.serve.tool_plan import CLOSE, MAX_PARALLEL_CALLS, OPEN, ToolPlan, tools_of
from edgekv.serve.tool_stream import HEAD_END, HEAD_START


def _literal(tok: GrammarTokenizer | None, text: str) -> str:
    """The Lark for a marker: <text> where the tokenizer has it as one special token (a string
    literal could not match it), else a string literal."""
    if tok is not None:
        ids = tok.ll.tokenize_str(text, parse_special=True)
        if len(ids) == 1 and tok.ll.is_special_token(ids[0]):
            return text
    return json.dumps(text)


def tool_grammar(plan: ToolPlan, tok: GrammarTokenizer | None = None) -> Grammar | None:
    """The Lark grammar of a reply under `plan` (None for "none": the reply is free text).
    auto: any text without the opening marker, or text up to it (a lazy lexeme: the grammar is
    inert until the marker appears) and then calls; required / a named function: calls only.
    Each call: the marker, {"name": one of the tools, "arguments": that tool's schema}, the
    closing marker; when parallel calls are allowed, up to MAX_PARALLEL_CALLS of them, separated
    by a newline; then the reply ends (nothing may follow the list)."""
    if not plan.calls_possible:
        return None
    op, cl = _literal(tok, OPEN), _literal(tok, CLOSE)
    rules = ["%llguidance {}"]
    if plan.choice == "auto":
        if op.startswith('"'):
            rules += ["start: TEXT | head calls", f"head[lazy]: TEXT {op}"]
        else:  # a special token ends free text by itself
            rules += [f"start: TEXT | TEXT {op} calls"]
        rules.append(r"TEXT: /(.|\n)*/")
    else:
        rules.append(f"start: {op} calls")
    more = MAX_PARALLEL_CALLS - 1 if plan.parallel else 0
    rules.append(f'calls: call ("\\n" {op} call){{0,{more}}}' if more else "calls: call")
    alts = " | ".join(f"fn_{i}" for i in range(len(plan.tools)))
    rules.append(f'call: "\\n{{\\"name\\": \\"" ({alts}) "}}\\n" {cl}')
    for i, t in enumerate(plan.tools):  # names are [a-zA-Z0-9_-]: nothing to escape
        rules.append(f'fn_{i}: "{t.name}\\", \\"arguments\\": " args_{i}')
        try:
            rules.append(f"args_{i}: {lark_json(closed_objects(t.parameters), f'the parameters of {t.name}')}")
        except GrammarError as e:
            raise bad_request(str(e), "tools") from None
    patterns = tuple(dict.fromkeys(p for t in plan.tools for p in counted_patterns(t.parameters)))
    try:
        # each pattern also tried alone by compile_grammar
        return lark("\n".join(rules), patterns, 0 if plan.choice == "auto" else min_call_chars(plan))
    except GrammarError as e:
        raise bad_request(f"tools: {e}", "tools") from None


def closed_objects(schema: dict) -> dict:
    """A copy of a tool's parameters in which an object that does not say `additionalProperties`
    allows no keys beyond its properties (as llama.cpp's grammars do: greedy SmolLM2-135M filled
    get_weather's arguments with invented keys until max_tokens). Not inside allOf, nor beside
    allOf or $ref (their intersection would lose the other side's keys)."""
    out = json.loads(json.dumps(schema))
    stack = [out]
    while stack:
        s = stack.pop()
        if not isinstance(s, dict):
            continue
        if isinstance(s.get("properties"), dict) and "additionalProperties" not in s \
                and "allOf" not in s and "$ref" not in s:
            s["additionalProperties"] = False
        for key, v in s.items():
            if key in ("properties", "$defs", "definitions") and isinstance(v, dict):
                stack.extend(v.values())
            elif key in ("anyOf", "oneOf", "prefixItems") and isinstance(v, list):
                stack.extend(v)
            elif key in ("items", "additionalProperties") and isinstance(v, dict):
                stack.append(v)
    return out


def min_call_chars(plan: ToolPlan) -> int:
    """The fewest characters one call of the plan's tools takes, as the grammar writes it."""
    frame = len(OPEN) + len(HEAD_START) + len(HEAD_END) + len("}\n") + len(CLOSE)
    return min(frame + len(t.name) + checks.schema_min_chars(t.parameters) for t in plan.tools)


def max_tokens_asked(body: dict) -> int | None:
    """The request's own cap on reply tokens (max_completion_tokens, max_tokens; Responses' max_output_tokens)."""
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        v = body.get(key)
        if type(v) is int and v > 0:
            return v
    return None


def check_fits(grammar: Grammar | None, tok: GrammarTokenizer, max_tokens: int | None, param: str) -> None:
    """A 400 where no reply the grammar allows can close within max_tokens: its shortest
    reply (grammar.min_chars, a lower bound) needs more tokens than that even if every token were
    the vocabulary's longest."""
    if grammar is None or max_tokens is None or not grammar.min_chars:
        return
    least = math.ceil(grammar.min_chars / tok.max_token_bytes) if grammar.min_chars < checks.BIG else None
    if least is None:
        raise bad_request(f"{param}: no reply can ever close: the schema requires a value inside itself (a required "
                          "$ref back to where it started) or allows none (false)", param)
    if least > max_tokens:
        raise bad_request(f"{param}: the shortest reply it allows is {grammar.min_chars} characters, at least {least} "
                          f"tokens of this model, and max_tokens is {max_tokens}: it could not close; raise max_tokens",
                          "max_tokens")


def request_grammar(body: dict, tok: GrammarTokenizer, max_tokens: int | None = None):
    """A chat request's (Grammar or None, ToolPlan or None, the field it came from), checked but
    not compiled: from its response_format, tools, tool_choice and parallel_tool_calls; max_tokens
    (None: the body's own) refuses a grammar that could not close within it. A 400 for what
    cannot be served (response_format with callable tools is not combined yet)."""
    plan = tools_of(body)
    rf = response_format_grammar(body.get("response_format"))
    if rf is not None and plan is not None and plan.calls_possible:
        raise bad_request("'response_format' together with callable 'tools' is not supported yet "
                          "(tool_choice none, or one of the two)", "response_format", code="unsupported_parameter")
    grammar, param = (tool_grammar(plan, tok), "tools") if plan is not None and plan.calls_possible \
        else (rf, "response_format")
    check_fits(grammar, tok, max_tokens if max_tokens is not None else max_tokens_asked(body), param)
    return grammar, plan, param


def constraint_of(compiled, plan: ToolPlan | None, tok: GrammarTokenizer):
    """The compiled grammar as the request's constraint: under parallel calls, one that ends the
    reply at a call repeating an earlier one (tool_constraint.py)."""
    if compiled is not None and plan is not None and plan.calls_possible and plan.parallel:
        return RepeatStops(compiled, tok)
    return compiled


def request_constraint(body: dict, tok: GrammarTokenizer, max_tokens: int | None = None):
    """A chat request's constraint (None: free) and ToolPlan (None: no tools): request_grammar,
    compiled on the grammar workers (this thread waits; an event loop awaits
    request_constraint_async instead)."""
    grammar, plan, param = request_grammar(body, tok, max_tokens)
    return constraint_of(compile_for_request(tok, grammar, param), plan, tok), plan


async def request_constraint_async(body: dict, tok: GrammarTokenizer, max_tokens: int | None = None):
    """request_constraint with the compile awaited (checks here: cheap; the build on the workers)."""
    grammar, plan, param = request_grammar(body, tok, max_tokens)
    return constraint_of(await compile_for_request_async(tok, grammar, param), plan, tok), plan
