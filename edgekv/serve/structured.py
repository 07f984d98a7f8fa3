"""`response_format` (OpenAI's chat field) -> the Grammar a reply must follow, or a 400
(api.bad_request; docs/structured.md). Pure functions: the HTTP layer calls them and compiles the
grammar with the bundle's tokenizer (edgekv/runtime/grammar_constraint.py, grammar_worker.py)."""
from __future__ import annotations

import re

from edgekv.runtime.grammar_build import json_object, json_schema
from edgekv.runtime.grammar_engine import Grammar, GrammarError
from edgekv.runtime.grammar_tokenizer import GrammarTokenizer
from edgekv.runtime.grammar_worker import compile_async, compile_bounded
from edgekv.serve.api import bad_request

# OpenAI's rule for a response format's (and a function's) name
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def response_format_grammar(rf) -> Grammar | None:
    """The grammar `response_format` asks for: None for absent or {"type": "text"}; any JSON
    object for json_object; the schema for json_schema (strict or not, it is always enforced)."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("'response_format' must be an object whose type is text, json_object or json_schema",
                          "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return json_object()
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request("response_format.json_schema must be an object with a name and a schema", "response_format")
    if not isinstance(js.get("name"), str) or not NAME.fullmatch(js["name"]):
        raise bad_request("response_format.json_schema.name must be 1-64 letters, digits, _ or -", "response_format")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad_request("response_format.json_schema.strict must be true, false or null", "response_format")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise bad_request("response_format.json_schema.description must be a string", "response_format")
    if not isinstance(js.get("schema"), dict):
        raise bad_request("response_format.json_schema.schema must be a JSON Schema object", "response_format")
    try:
        return json_schema(js["schema"])
    except GrammarError as e:
        raise bad_request(f"response_format: {e}", "response_format") from None


def compile_for_request(tok: GrammarTokenizer, grammar: Grammar | None, param: str):
    """The constraint of one request (None: unconstrained); a grammar the engine cannot enforce
    is a 400 naming the field it came from."""
    if grammar is None:
        return None
    try:
        return compile_bounded(tok, grammar)  # on the grammar workers (runtime/grammar_worker.py)
    except GrammarError as e:
        raise bad_request(f"{param}: {e}", param) from None


async def compile_for_request_async(tok: GrammarTokenizer, grammar: Grammar | None, param: str):
    """compile_for_request awaited on an event loop: no thread waits while the workers build it."""
    if grammar is None:
        return None
    try:
        return await compile_async(tok, grammar)
    except GrammarError as e:
        raise bad_request(f"{param}: {e}", param) from None


# -- logprobs --------------------------------------------------------------------------------------

MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit (completions: 5)


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """How many alternatives a request wants per token (None: no logprobs). Chat: `logprobs`
    true/false and `top_logprobs` 0-20 (which needs logprobs); completions: `logprobs` 0-5."""
    lp = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise bad_request("'logprobs' must be true, false or null", "logprobs")
        if top is not None and (type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise bad_request(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        if top and not lp:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if lp else None
    if lp is None:
        return None
    if type(lp) is not int or not 0 <= lp <= 5:
        raise bad_request("'logprobs' must be an integer in [0, 5] or null", "logprobs")
    return lp


def _piece(token: int, logprob: float, token_bytes) -> dict:
    b = token_bytes(token)
    return {"token": b.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(b)}


def chat_logprobs(entries, token_bytes) -> dict:
    """OpenAI's chat `choices[].logprobs` for sampling.TokenLogprob entries; token_bytes(id) is a
    token's own bytes (a piece of a UTF-8 character is shown as U+FFFD, its bytes exact)."""
    return {"content": [{**_piece(e.token, e.logprob, token_bytes),
                         "top_logprobs": [_piece(t, lp, token_bytes) for t, lp in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries, token_bytes, text_offset: int = 0) -> dict:
    """The completions API's `logprobs`: tokens, token_logprobs, top_logprobs (token -> logprob)
    and text_offset (each token's start in the text, counting from `text_offset`)."""
    tokens = [token_bytes(e.token).decode("utf-8", errors="replace") for e in entries]
    offsets, at = [], text_offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_bytes(t).decode("utf-8", errors="replace"): lp for t, lp in e.top}
                             for e in entries], "text_offset": offsets}
