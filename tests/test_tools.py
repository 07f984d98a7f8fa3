"""Tool calling (edgekv/serve/tools.py): the request's tools and tool_choice, the grammar for
auto / required / a named function / parallel calls (driven token by token on SmolLM2's real
tokenizer, and sampled on the tiny model whose random replies must still be valid calls:
jsonschema is the oracle), the prompt (the generic format on SmolLM2's template, a Qwen2.5-style
tool template), and replies -> tool_calls, streamed pieces reassembled = the non-streamed reply."""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="tool calls need llguidance (the serve extra)")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is the oracle (the test extra)")

from edgekv.format.bundle import load_bundle  # noqa: E402
from edgekv.runtime.grammar_constraint import compile_grammar  # noqa: E402
from edgekv.runtime.grammar_engine import GrammarError  # noqa: E402
from edgekv.runtime.grammar_tokenizer import tokenizer_for  # noqa: E402
from edgekv.runtime.sampling import SamplingParams  # noqa: E402
from edgekv.runtime.text import TextCodec, bounded_sandbox  # noqa: E402
from edgekv.serve import tools as T  # noqa: E402
from edgekv.serve.tool_grammar import request_constraint, tool_grammar  # noqa: E402
from edgekv.serve.tool_plan import EMPTY_PARAMETERS, call_text, tools_of  # noqa: E402
from edgekv.serve.tool_stream import (ToolCallError, ToolStream, assemble, check_arguments, finish_reason,  # noqa: E402
                                      parse_reply)
from edgekv.serve.api import ApiError  # noqa: E402
from tests.conftest import run_constrained  # noqa: E402


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
LIGHTS = {"type": "function", "function": {
    "name": "set_lights", "description": "Turn the lights of a room on or off",
    "parameters": {"type": "object", "properties": {"room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"},
                                                    "level": {"type": "integer", "minimum": 0, "maximum": 100}},
                   "required": ["room", "on"], "additionalProperties": False}}}
TOOLS = [WEATHER, LIGHTS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def ids(i: int) -> str:
    return f"call_{i}"


@pytest.fixture(scope="module")
def tok(real_bundle_int4):
    """SmolLM2's own tokenizer (the bundle conftest exports once per run: CI tests these too)."""
    return tokenizer_for(load_bundle(real_bundle_int4))


def plan(**body):
    return tools_of({"tools": TOOLS, **body})


def admits(tok, p, text: str) -> bool:
    c = compile_grammar(tok, tool_grammar(p, tok))
    for t in tok.ll.tokenize_str(text):
        if not c.allowed()[t]:
            return False
        c.accept(t)
    return c.is_accepting()


def call(name, args) -> str:
    return call_text(name, args)


W = call("get_weather", {"city": "Paris", "unit": "C"})
L = call("set_lights", {"room": "hall", "on": True, "level": 30})


# -- the request's fields ----------------------------------------------------------------------------

def test_tools_and_tool_choice():
    assert tools_of({}) is None and tools_of({"tools": [], "tool_choice": "none"}) is None
    p = plan()
    assert (p.choice, p.parallel, [t.name for t in p.tools]) == ("auto", True, ["get_weather", "set_lights"])
    assert plan(tool_choice="required", parallel_tool_calls=False).parallel is False
    named = plan(tool_choice={"type": "function", "function": {"name": "set_lights"}})
    assert named.choice == "function" and [t.name for t in named.tools] == ["set_lights"]
    assert [t.name for t in named.offered] == ["get_weather", "set_lights"]
    bare = tools_of({"tools": [{"type": "function", "function": {"name": "ping"}}]})
    assert bare.tools[0].parameters == EMPTY_PARAMETERS


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": [WEATHER] * 200}, "tools"),
])
def test_malformed_tool_fields_are_400s(body, param):
    with pytest.raises(ApiError) as e:
        tools_of(body)
    assert e.value.param == param


def test_unenforceable_parameters_are_400s(tok):
    p = tools_of({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}]})
    with pytest.raises(GrammarError, match="uniqueItems"):
        compile_grammar(tok, tool_grammar(p, tok))


# -- the grammar ---------------------------------------------------------------------------------------

def test_auto_lets_text_and_calls_mix(tok):
    p = plan()
    assert admits(tok, p, "The weather is fine today.")
    assert admits(tok, p, W)
    assert admits(tok, p, "Let me look.\n" + W)
    assert admits(tok, p, W + "\n" + L)  # parallel calls
    assert not admits(tok, p, "Let me look. <tool_call> then prose")  # after the marker: a call
    assert not admits(tok, p, call("get_weather", {"city": "Paris", "unit": "K"}))  # the schema holds
    assert not admits(tok, p, call("delete_all", {}))  # only the tools


def test_after_the_marker_the_call_is_forced(tok):
    c = compile_grammar(tok, tool_grammar(plan(), tok))
    for t in tok.ll.tokenize_str("Sure. <tool_call>"):
        c.accept(t)
    assert c.m.compute_ff_bytes().decode() == '\n{"name": "'


def test_required_named_and_single(tok):
    req = plan(tool_choice="required")
    assert admits(tok, req, W) and admits(tok, req, W + "\n" + L)
    assert not admits(tok, req, "No call.") and not admits(tok, req, "Text first\n" + W)
    named = plan(tool_choice={"type": "function", "function": {"name": "set_lights"}})
    assert admits(tok, named, L) and not admits(tok, named, W) and not admits(tok, named, L + "\n" + L)
    single = plan(tool_choice="required", parallel_tool_calls=False)
    assert admits(tok, single, W) and not admits(tok, single, W + "\n" + L)
    assert tool_grammar(plan(tool_choice="none"), tok) is None


@pytest.fixture(scope="module")
def rt(rt_int8):
    return rt_int8  # conftest's tiny int8 runtime


def sampled(rt, p, seed: int) -> tuple[str, str]:
    """(text, finish reason) of a reply sampled under the tool grammar, through the batcher."""
    gtok = tokenizer_for(rt.bundle)
    ids, st, _ = run_constrained(rt, compile_grammar(gtok, tool_grammar(p, gtok)), rt.codec.encode("Call a tool:"), 200,
                                 SamplingParams(temperature=1.0, seed=seed), rt.codec.stop_ids | set(gtok.stop_ids))
    return rt.codec.decode(ids), st.stop_reason


def blocks(text: str) -> list[dict]:
    """The oracle's reading of the calls: each block between the markers, parsed whole."""
    return [json.loads(b) for b in re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_lights"}}])
def test_random_models_calls_validate_and_stream_as_they_parse(rt, choice):
    """One call each (a random model would rarely stop adding parallel ones within max tokens)."""
    rng = random.Random(0)
    for seed in range(8):
        text, reason = sampled(rt, plan(tool_choice=choice, parallel_tool_calls=False), seed)
        assert reason == "stop", text
        msg, complete = parse_reply(text, ids)
        assert finish_reason(reason, msg) == "tool_calls" and complete == len(msg["tool_calls"]) >= 1
        assert msg["content"] is None
        for c, block in zip(msg["tool_calls"], blocks(text), strict=True):
            args = json.loads(c["function"]["arguments"])
            assert c["function"]["name"] == block["name"] and args == block["arguments"]
            jsonschema.validate(args, SCHEMAS[c["function"]["name"]])
            if isinstance(choice, dict):
                assert c["function"]["name"] == "set_lights"
        assert_streams_as_parsed(text, rng)


def assert_streams_as_parsed(text: str, rng: random.Random) -> None:
    whole, _ = parse_reply(text, ids)
    for _ in range(6):
        ts, deltas, at = ToolStream(ids), [], 0
        while at < len(text):
            n = rng.randint(1, 7)
            deltas += ts.feed(text[at: at + n])
            at += n
        deltas += ts.finish()
        assert assemble(deltas) == whole
        seen = set()
        for d in deltas:  # OpenAI's order: id, type and name once, first; then arguments only
            for c in d.get("tool_calls", []):
                first = c["index"] not in seen
                seen.add(c["index"])
                assert ("id" in c and "name" in c["function"]) == first
                assert not first or c["function"]["arguments"] == ""


@pytest.mark.parametrize("text", [
    "Just text, no call.",
    "Let me check.\n" + W,
    W + "\n" + L,
    "Before " + W + "\nafter",
    "a <tool_call> that is no call",
    "cut inside " + W[:30],
    "cut at <tool_ca",
    "spaces   \n\n",
])
def test_stream_reassembly_equals_the_whole_reply(text):
    assert_streams_as_parsed(text, random.Random(1))


def test_parse_reply():
    msg, n = parse_reply("Let me check.\n" + W + "\n" + L, ids)
    assert msg["content"] == "Let me check." and n == 2
    assert [c["id"] for c in msg["tool_calls"]] == ["call_0", "call_1"]
    assert json.loads(msg["tool_calls"][1]["function"]["arguments"]) == {"room": "hall", "on": True, "level": 30}
    assert finish_reason("stop", msg) == "tool_calls" and finish_reason("length", msg) == "length"
    text_only, n = parse_reply("a <tool_call> that is no call", ids)
    assert text_only == {"role": "assistant", "content": "a <tool_call> that is no call"} and n == 0
    assert finish_reason("stop", text_only) == "stop"
    cut, n = parse_reply(W[:-20], ids)  # inside the arguments
    assert n == 0 and len(cut["tool_calls"]) == 1
    with pytest.raises(ToolCallError):
        check_arguments(cut)


# -- the prompt ----------------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": '{"temp": 21}'},
]


def test_messages_checked():
    msgs = T.chat_messages(CONVERSATION)
    assert msgs[1]["content"] == "" and msgs[1]["tool_calls"][0]["arguments"] == {"city": "Paris", "unit": "C"}
    assert msgs[2] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_a", "name": "get_weather"}
    for bad in ([{"role": "tool", "tool_call_id": "nope", "content": "x"}],
                [CONVERSATION[0], {"role": "assistant", "content": None}],
                [CONVERSATION[0], {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}],
                [{"role": "wizard", "content": "x"}]):
        with pytest.raises(ApiError) as e:
            T.chat_messages(bad)
        assert e.value.param == "messages"


def test_generic_format_on_smollm2s_template(real_bundle_int4):
    bundle = load_bundle(real_bundle_int4)
    assert not T.template_takes_tools(bundle.chat_template)
    codec = TextCodec(bundle)
    prompt = T.render_prompt(codec, T.chat_messages(CONVERSATION), plan(tool_choice="required"), takes_tools=False)
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n") and "SmolLM" not in system  # the tools replace its default
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(x) for x in listed] == TOOLS
    assert "Answer with a function call." in system
    assert ("<|im_start|>assistant\n" + call("get_weather", {"city": "Paris", "unit": "C"}) + "<|im_end|>") in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


# the tool part of Qwen2.5's chat template (Hermes-style: tools in the system turn, calls in
# <tool_call> blocks, results as <tool_response> in a user turn)
QWEN_TOOLS_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


class QwenStyleCodec:
    """The tiny bundle's tokenizer with a Qwen2.5-style tool template in the same bounded sandbox."""

    def __init__(self, bundle):
        self.inner = TextCodec(bundle)
        env = bounded_sandbox()(trim_blocks=True, lstrip_blocks=True)
        self.template, self.special = env.from_string(QWEN_TOOLS_TEMPLATE), bundle.special

    def render(self, messages):  # the path without tools: not taken here
        raise AssertionError("the template takes tools: render_prompt must pass them to it")


def test_template_path_on_a_qwen25_style_template(rt):
    assert T.template_takes_tools(QWEN_TOOLS_TEMPLATE)
    codec = QwenStyleCodec(rt.bundle)
    prompt = T.render_prompt(codec, T.chat_messages(CONVERSATION), plan(), takes_tools=True)
    listed = prompt.split("tags:\n<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(x) for x in listed] == TOOLS
    turn = prompt.split("<|im_start|>assistant\n<tool_call>\n")[1].split("\n</tool_call><|im_end|>")[0]
    assert json.loads(turn) == {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # what the template shows a call as is what the grammar makes and the parser reads
    msg, n = parse_reply("<tool_call>\n" + turn + "\n</tool_call>", ids)
    assert n == 1 and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "unit": "C"}
    text, reason = sampled(rt, plan(tool_choice="required", parallel_tool_calls=False), 3)
    assert reason == "stop" and parse_reply(text, ids)[1] >= 1


def test_request_constraint(tok):
    c, p = request_constraint({"tools": TOOLS, "tool_choice": "required"}, tok)
    assert p.choice == "required" and c is not None and not c.allowed()[tok.ll.tokenize_str("Hi")[0]]
    c, p = request_constraint({"response_format": {"type": "json_object"}}, tok)
    assert p is None and c is not None
    body = {"tools": TOOLS, "tool_choice": "none", "response_format": {"type": "json_object"}}
    c, p = request_constraint(body, tok)
    assert p.choice == "none" and c is not None  # the tools are described, the reply is JSON
    assert request_constraint({}, tok) == (None, None)
    with pytest.raises(ApiError) as e:
        request_constraint({"tools": TOOLS, "response_format": {"type": "json_object"}}, tok)
    assert e.value.param == "response_format" and e.value.code == "unsupported_parameter"
