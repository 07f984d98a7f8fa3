"""Issue 41 item 1: a grammar's cost is bounded per request and reaches no other request. The
storm's patterns are 400s naming what is too large, before any cell is taken; the build runs on
the grammar workers within a CPU budget; a row whose mask passes its budget ends alone, its
neighbour completes; a schema's own x-guidance cannot unbound whitespace. Functional only: the
timings are tests/grammar_storm.py's (docs/structured.md)."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

pytest.importorskip("llguidance", reason="grammars need llguidance (the serve extra)")

from edgekv.format.bundle import load_bundle  # noqa: E402
from edgekv.runtime.grammar_build import json_schema, lark, lark_json  # noqa: E402
from edgekv.runtime.grammar_constraint import compile_grammar  # noqa: E402
from edgekv.runtime.grammar_engine import GrammarError  # noqa: E402
from edgekv.runtime.grammar_tokenizer import tokenizer_for  # noqa: E402
from edgekv.runtime.grammar_worker import compile_async, compile_bounded  # noqa: E402
from edgekv.runtime.memory import give_memory_back  # noqa: E402
from edgekv.runtime import grammar_checks as checks  # noqa: E402
from edgekv.runtime.sampling import SamplingParams  # noqa: E402
from tests.serving import serving  # noqa: E402

STORM = [r"^(a{1000}){1000}$", r"^([a-z]{1,500}){1,500}$", r"^(.{0,900}x){1,200}$",
         r"^((a|b|c|d|e|f|g|h){1,300}){1,300}$"]
WORD = {"type": "object", "properties": {"w": {"type": "string", "maxLength": 8}}, "required": ["w"],
        "additionalProperties": False}


def with_pattern(p: str) -> dict:
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": p}}, "required": ["s"]}


@pytest.fixture(scope="module")
def tok(tiny_bundle_int8):
    return tokenizer_for(load_bundle(tiny_bundle_int8))


@pytest.fixture(scope="module")
def served(rt_int8):
    with serving(rt_int8) as s:
        yield s


@pytest.mark.parametrize("pattern, said", [(STORM[0], "matches nothing shorter than 1000000 characters"),
                                           (STORM[1], "spell out up to 250000 characters"),
                                           (STORM[2], "spell out up to 180200 characters"),
                                           (STORM[3], "spell out up to 720000 characters")])
def test_the_storms_patterns_are_400s_naming_the_size_before_any_cell(served, pattern, said, monkeypatch):
    submitted = []
    monkeypatch.setattr(served.batcher, "submit", lambda req: submitted.append(req))  # a cell would be taken there
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": with_pattern(pattern)}}}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert said in err["message"] and pattern[:20] in err["message"] and err["param"] == "response_format"
    # the same pattern in a tool's parameters is refused as well
    tool = {"type": "function", "function": {"name": "f", "parameters": with_pattern(pattern)}}
    r = httpx.post(served.url + "/v1/chat/completions", json={**body, "response_format": None, "tools": [tool]},
                   timeout=60)
    assert r.status_code == 400 and said in r.json()["error"]["message"] and r.json()["error"]["param"] == "tools"
    assert submitted == []


@pytest.mark.parametrize("pattern, spelled", [
    (r"\d{3}-\d{4}", 8), (r"^(\d{1,3}\.){3}\d{1,3}$", 15), ("[a-z]+", 1), ("x{2,}", 2), ("(ab)*", 2),
    ("(a{1000}){1,1000}", 10 ** 6), ("(a|bc){10}", 30), ("(?=a{50})b", 1), (r"^(.{0,100}x){1,100}$", 10100),
])
def test_regex_spelled_counts_what_counted_repetitions_spell_out(pattern, spelled):
    assert checks.regex_spelled(pattern) == spelled


def test_patterns_within_the_limits_still_compile(tok):
    for p in (r"^(\d{1,3}\.){3}\d{1,3}$", r"^[a-z]{0,16000}$", r"^([A-Z0-9]{4}-){3}[A-Z0-9]{4}$"):
        compile_grammar(tok, json_schema(with_pattern(p)))


def test_a_build_past_its_cpu_budget_is_refused_naming_it(tok):
    with pytest.raises(GrammarError, match=r"building it took .* more than the 0 s a request's grammar may take"):
        compile_grammar(tok, json_schema(WORD), budget_s=0.0)


def test_grammars_are_built_on_the_grammar_workers(tok, monkeypatch):
    from edgekv.runtime import grammar_constraint, grammar_worker
    seen = []
    real = grammar_constraint.compile_grammar

    def watched(*a, **kw):
        seen.append(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(grammar_worker, "compile_grammar", watched)
    assert compile_bounded(tok, json_schema(WORD)).allowed().any()
    assert asyncio.run(compile_async(tok, json_schema(WORD))).allowed().any()
    assert len(seen) == 2 and all(n.startswith("edgekv-grammar") for n in seen), seen
    with pytest.raises(GrammarError, match="building it took"):  # its errors come back to the caller
        monkeypatch.setattr(grammar_worker, "compile_grammar", lambda t, gr: real(t, gr, budget_s=0.0))
        compile_bounded(tok, json_schema(WORD))


def test_a_mask_past_its_budget_ends_the_reply_and_says_so_once(tok):
    c = compile_grammar(tok, json_schema(WORD))
    c.mask_budget_s = 0.0
    with pytest.raises(GrammarError, match="one token's mask took .* more than the 0 ms") as first:
        c.allowed()
    with pytest.raises(GrammarError) as again:  # the same error, not a second mask
        c.allowed()
    assert again.value is first.value and c.masks == 0


def test_a_row_past_its_mask_budget_ends_alone_and_its_neighbour_completes(rt_int8, tok):
    from edgekv.runtime.batching import Request

    rt = rt_int8
    bt = rt.batcher(capacity=256, parallel=4, max_queue=8, prefill_chunk=32)
    over, fine = compile_grammar(tok, json_schema(WORD)), compile_grammar(tok, json_schema(WORD))
    over.mask_budget_s = 0.0
    stops = rt.codec.stop_ids | set(tok.stop_ids)
    reqs = [Request(rt.codec.encode("Answer:"), 30, SamplingParams(temperature=1.0, seed=s), stops, constraint=c)
            for s, c in ((1, over), (2, fine), (3, None))]
    for r in reqs:
        bt.submit(r)
    while bt.step():
        pass
    bt.post.close()
    assert reqs[0].finish_reason == "error" and "mask took" in (reqs[0].error or ""), (reqs[0].finish_reason,
                                                                                        reqs[0].error)
    assert reqs[0].out == []
    assert reqs[1].finish_reason in ("stop", "length") and reqs[1].out
    assert reqs[2].finish_reason in ("stop", "length") and reqs[2].out


@pytest.mark.parametrize("own", [{"whitespace_pattern": r"[ \n]+"}, {"whitespace_flexible": True},
                                 {"item_separator": r"\s*,\s*", "key_separator": r"\s*:\s*"}])
def test_a_schemas_own_x_guidance_cannot_unbound_whitespace(tok, own):
    schema = {**WORD, "x-guidance": own}
    for grammar in (json_schema(schema), lark("start: " + lark_json(schema))):
        c = compile_grammar(tok, grammar)
        for t in tok.ll.tokenize_str('{"w"'):
            c.allowed()
            c.accept(t)
        space, runs = tok.ll.tokenize_str(" ")[0], 0
        while runs < 50 and c.allowed()[space]:
            c.accept(space)
            runs += 1
        assert runs <= 21, (own, runs)


def test_freed_grammar_memory_goes_back_to_the_system():
    import platform
    assert give_memory_back() == (platform.libc_ver()[0] == "glibc")


def _accepts(tok, grammar, text: str) -> bool:
    """The grammar takes `text` whole and may end there."""
    c = compile_grammar(tok, grammar)
    for t in tok.ll.tokenize_str(text):
        if not c.allowed()[t]:
            return False
        c.accept(t)
    return c.is_done() or bool(c.allowed()[tok.stop_ids[0]])


@pytest.mark.parametrize("schema", [{"type": "integer"}, {"type": ["integer", "null"]},
                                    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
                                    {"type": "array", "items": {"anyOf": [{"type": "integer"}]}}])
def test_an_unbounded_integer_is_held_to_json_safe_digits(tok, schema):
    """The openai client's parse() of a pydantic int ran 300 tokens of digits (issue 43): an integer
    without bounds of its own is held to +-(2**53 - 1), what every JSON parser keeps exactly."""
    def wrap(n: str) -> str:
        return {"integer": n, "object": '{"n": ' + n + "}", "array": "[" + n + "]"}.get(
            schema["type"] if isinstance(schema["type"], str) else "integer")
    for grammar in (json_schema(schema), lark("start: " + lark_json(schema)) if "properties" in schema else None):
        if grammar is None:
            continue
        assert _accepts(tok, grammar, wrap(str(2 ** 53 - 1))) and _accepts(tok, grammar, wrap(str(-(2 ** 53 - 1))))
        assert not _accepts(tok, grammar, wrap(str(2 ** 53))) and not _accepts(tok, grammar, wrap("1" * 40))


def test_a_schemas_own_integer_bounds_and_its_data_are_kept():
    from edgekv.runtime.grammar_build import SAFE_INTEGER, bounded_integers

    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0},
                                               "b": {"type": "integer", "exclusiveMaximum": 10 ** 20}},
              "const": {"type": "integer"}, "default": {"type": "integer"}}
    out = bounded_integers(schema)
    assert out["properties"]["a"] == {"type": "integer", "minimum": 0, "maximum": SAFE_INTEGER}
    assert out["properties"]["b"] == {"type": "integer", "exclusiveMaximum": 10 ** 20, "minimum": -SAFE_INTEGER}
    assert out["const"] == out["default"] == {"type": "integer"}  # data, not a schema
    assert schema["properties"]["a"] == {"type": "integer", "minimum": 0}  # the caller's schema untouched
