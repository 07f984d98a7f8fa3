"""Issue 43 item 4: tool calls end when the call list ends. Under required and auto the grammar
admits one list of at most MAX_PARALLEL_CALLS calls and nothing after it; a call repeating an
earlier one ends the reply and is dropped (streamed: never shown); a structured reply that could
not close within max_tokens is a 400 before it starts. Driven on SmolLM2's real tokenizer."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("llguidance", reason="tool calls need llguidance (the serve extra)")
pytest.importorskip("jsonschema", reason="tests.test_tools needs jsonschema (the test extra)")

from edgekv.format.bundle import load_bundle  # noqa: E402
from edgekv.runtime.grammar_tokenizer import tokenizer_for  # noqa: E402
from edgekv.serve.tool_grammar import min_call_chars, request_constraint, request_grammar  # noqa: E402
from edgekv.serve.tool_plan import MAX_PARALLEL_CALLS  # noqa: E402
from edgekv.serve.tool_stream import parse_reply  # noqa: E402
from edgekv.serve.api import ApiError  # noqa: E402
from tests.test_tools import TOOLS, assert_streams_as_parsed, call, ids  # noqa: E402

PARIS = call("get_weather", {"city": "Paris", "unit": "C"})
ROME = call("get_weather", {"city": "Rome", "unit": "C"})
HALL = call("set_lights", {"room": "hall", "on": True})


@pytest.fixture(scope="module")
def tok(real_bundle_int4):
    return tokenizer_for(load_bundle(real_bundle_int4))


def constraint(tok, **body):
    c, _ = request_constraint({"tools": TOOLS, **body}, tok)
    return c


def drive(c, tok, text: str) -> tuple[bool, bool]:
    """(every token of `text` allowed until the end or the constraint was done, it is done)."""
    for t in tok.ll.tokenize_str(text):
        if c.is_done():
            return True, True
        if not c.allowed()[t]:
            return False, False
        c.accept(t)
    return True, c.is_done()


def test_the_list_is_bounded_and_nothing_follows_it(tok):
    calls = [call("get_weather", {"city": f"c{i}", "unit": "C"}) for i in range(MAX_PARALLEL_CALLS + 1)]
    for choice in ("required", "auto"):
        ok, done = drive(constraint(tok, tool_choice=choice), tok, "\n".join(calls[:MAX_PARALLEL_CALLS - 1]))
        assert ok and not done, choice
        c = constraint(tok, tool_choice=choice)
        ok, done = drive(c, tok, "\n".join(calls[:MAX_PARALLEL_CALLS]))
        assert ok and done and not c.allowed()[tok.ll.tokenize_str("\n")[0]], choice  # the list is full: it ends
        ok, _ = drive(constraint(tok, tool_choice=choice), tok, PARIS + "\nThat is all.")
        assert not ok, choice  # text after the list


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_repeated_call_ends_the_reply_distinct_ones_go_on(tok, choice):
    ok, done = drive(constraint(tok, tool_choice=choice), tok, PARIS + "\n" + ROME + "\n" + HALL)
    assert ok and not done  # three distinct calls: the list may go on
    c = constraint(tok, tool_choice=choice)
    ok, done = drive(c, tok, PARIS + "\n" + ROME + "\n" + PARIS)
    assert ok and done  # the repeat's arguments closed: the reply ends there
    ok, done = drive(constraint(tok, tool_choice=choice), tok, PARIS + "\n" + PARIS[:-len('}\n</tool_call>') - 4])
    assert ok and not done  # a prefix of a repeat is not one yet


def test_single_call_plans_end_after_their_call(tok):
    for body in ({"tool_choice": "required", "parallel_tool_calls": False},
                 {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}):
        c = constraint(tok, **body)
        ok, done = drive(c, tok, PARIS)
        assert ok and done, body


@pytest.mark.parametrize("text, names", [
    (PARIS + "\n" + PARIS, ["get_weather"]),
    (PARIS + "\n" + ROME + "\n" + PARIS, ["get_weather", "get_weather"]),
    (PARIS + "\n" + HALL, ["get_weather", "set_lights"]),
    ("Let me see.\n" + HALL + "\n" + HALL, ["set_lights"]),
])
def test_a_repeat_is_dropped_whole_and_streamed(text, names):
    msg, complete = parse_reply(text, ids)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == names and complete == len(names)
    assert [c["id"] for c in msg["tool_calls"]] == [ids(i) for i in range(len(names))]
    rng = random.Random(7)
    for _ in range(30):
        assert_streams_as_parsed(text, rng)


def test_a_cut_call_that_began_like_an_earlier_one_is_shown_as_far_as_it_came():
    cut = PARIS + "\n" + PARIS[: PARIS.index("Paris") + 3]
    msg, complete = parse_reply(cut, ids)
    assert complete == 1 and len(msg["tool_calls"]) == 2
    assert msg["tool_calls"][1]["function"]["arguments"] == '{"city": "Par'


def test_a_reply_that_cannot_close_within_max_tokens_is_a_400(tok):
    long_const = {"type": "object", "properties": {"k": {"const": "x" * 2000}}, "required": ["k"]}
    rf = {"type": "json_schema", "json_schema": {"name": "k", "schema": long_const}}
    with pytest.raises(ApiError, match="could not close; raise max_tokens") as e:
        request_constraint({"response_format": rf, "max_tokens": 10}, tok)
    assert e.value.param == "max_tokens"
    assert request_constraint({"response_format": rf, "max_tokens": 2000}, tok)[0] is not None
    # the same through max_completion_tokens, and for tools, whose call is the shortest reply
    tool = {"type": "function", "function": {"name": "f", "parameters": long_const}}
    with pytest.raises(ApiError, match="could not close"):
        request_constraint({"tools": [tool], "tool_choice": "required", "max_completion_tokens": 10}, tok)
    # auto may answer in text: nothing to refuse
    assert request_constraint({"tools": [tool], "max_tokens": 10}, tok)[0] is not None
    endless = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
    rf = {"type": "json_schema", "json_schema": {"name": "e", "schema": endless}}
    with pytest.raises(ApiError, match="no reply can ever close"):
        request_constraint({"response_format": rf, "max_tokens": 100}, tok)


def test_the_front_ends_get_it_by_the_same_names(tok):
    """Anthropic's and Responses' front ends call tools_of, chat_messages, request_constraint,
    ToolStream and parse_reply: the old calls work, max_tokens may be passed in."""
    c, p = request_constraint({"tools": TOOLS, "tool_choice": "required"}, tok, max_tokens=300)
    assert p.parallel and drive(c, tok, PARIS + "\n" + PARIS) == (True, True)
    grammar, plan, param = request_grammar({"tools": TOOLS, "tool_choice": "required"}, tok)
    assert param == "tools" and plan.choice == "required" and grammar.min_chars == min_call_chars(plan)


def test_tool_arguments_allow_no_invented_keys_unless_the_schema_says_so(tok):
    open_city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    extra = call("get_weather", {"city": "Paris", "type": "string"})
    for params, admitted in ((open_city, False), ({**open_city, "additionalProperties": True}, True),
                             ({"allOf": [open_city]}, True)):
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
        c, _ = request_constraint({"tools": [tool], "tool_choice": "required"}, tok)
        assert drive(c, tok, extra)[0] == admitted, params
    assert "additionalProperties" not in open_city  # the client's schema is not changed
