"""OpenAI's Responses API on `edgekv serve`, through the official openai client, on the tiny
bundle: the same prompt through /v1/chat/completions and /v1/responses gives the same tokens at
temperature 0; the stream's events (response.created ... response.completed, sequence numbers
0, 1, 2, ...) reassembling to the whole response; a function-call round trip against the chat
API's; text.format json_schema; max_output_tokens -> incomplete; reasoning items; statelessness
(previous_response_id, store) refused by name."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
import httpx  # noqa: E402

from tests.serving import greedy_chat, serving, tools_url, url  # noqa: E402, F401  (url, tools_url: fixtures)
from tests.test_reasoning import SCRIPT, oracle, thinking_rt  # noqa: E402, F401  (the scripted thinking model)

SYSTEM = "The capital of France is Paris."
USER = "Tell me about robots and trains."
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "boolean"}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "weather", "description": "the weather in a city", "parameters": CITY}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                                  "parameters": CITY}}]




def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_responses_give_the_chat_apis_greedy_tokens(url):
    want = greedy_chat(url, {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                      "max_tokens": 24})
    r = client(url).responses.create(model="tiny", instructions=SYSTEM, input=USER, max_output_tokens=24,
                                     temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.store is False
    assert r.output_text == want["choices"][0]["message"]["content"]
    assert [o.type for o in r.output] == ["message"]
    assert r.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == want["usage"]["completion_tokens"]
    length = want["choices"][0]["finish_reason"] == "length"
    assert r.status == ("incomplete" if length else "completed")
    # the same conversation as items (a developer message is the system's)
    r2 = client(url).responses.create(model="tiny", max_output_tokens=24, temperature=0, input=[
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER}]}])
    assert r2.output_text == r.output_text and r2.usage.input_tokens == r.usage.input_tokens


def test_max_output_tokens_ends_incomplete(url):
    r = client(url).responses.create(model="tiny", input=USER, max_output_tokens=2, temperature=0)
    assert r.usage.output_tokens == 2
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].status == "incomplete" and r.max_output_tokens == 2  # the item it cut; the limit
    with client(url).responses.stream(model="tiny", input=USER, max_output_tokens=2, temperature=0) as st:
        events = list(st)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[-1].status == "incomplete" and events[-1].type == "response.incomplete"
    # no max_output_tokens: the response says the limit it ran under (edgekv's default, docs/serve.md)
    assert client(url).responses.create(model="tiny", input=USER, temperature=0).max_output_tokens == 256


def test_the_stream_is_the_responses_event_sequence_and_the_whole_response(url):
    body = {"model": "tiny", "input": USER, "max_output_tokens": 24, "temperature": 0}
    whole = client(url).responses.create(**body)
    with client(url).responses.stream(**body) as st:
        events = list(st)
    # (the client's get_final_response takes only response.completed; a reply cut at max_output_tokens
    # ends with response.incomplete, as OpenAI's does)
    final = events[-1].response
    assert final.output[0].content[0].text == whole.output_text and final.status == whole.status
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    kinds = [e.type for e in events]
    done = f"response.{whole.status}"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          done]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_function_call_round_trip_is_the_chat_apis(tools_url):
    c = client(tools_url)
    r = c.responses.create(model="tiny", input=USER, tools=TOOLS, tool_choice="required", max_output_tokens=160,
                           temperature=0, parallel_tool_calls=False)
    assert [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    args = json.loads(call.arguments)
    jsonschema.validate(args, CITY)
    want = greedy_chat(tools_url, {"messages": [{"role": "user", "content": USER}], "tools": OPENAI_TOOLS,
                            "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 160})
    assert json.loads(want["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == args
    # streamed: the arguments' deltas are the same call
    with c.responses.stream(model="tiny", input=USER, tools=TOOLS, tool_choice="required", max_output_tokens=160,
                            temperature=0, parallel_tool_calls=False) as st:
        events = list(st)
        final = st.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert final.output[0].type == "function_call" and final.output[0].name == "weather"
    # the output goes back: the same conversation as the chat API's tool message, the same reply
    back = c.responses.create(model="tiny", tools=TOOLS, max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": USER},
        {"type": "function_call", "call_id": call.call_id, "name": "weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    again = greedy_chat(tools_url, {"tools": OPENAI_TOOLS, "max_tokens": 12, "messages": [
        {"role": "user", "content": USER},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "weather", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]})
    assert back.usage.input_tokens == again["usage"]["prompt_tokens"]
    assert back.usage.output_tokens == again["usage"]["completion_tokens"]
    assert back.output_text == (again["choices"][0]["message"]["content"] or "")
    # an output for a call never made is refused
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="tiny", input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}])
    assert e.value.body["param"] == "input"


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["robot", "train"]}},
          "required": ["ok", "kind"], "additionalProperties": False}


def test_text_format_json_schema_holds_the_reply_to_it(url):
    fmt = {"format": {"type": "json_schema", "name": "r", "schema": SCHEMA, "strict": True}}
    r = client(url).responses.create(model="tiny", input=USER, text=fmt, max_output_tokens=200, temperature=1)
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"
    bad = {"format": {"type": "json_schema", "name": "r", "schema": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "("}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client(url).responses.create(model="tiny", input=USER, text=bad)
    assert e.value.body["param"] == "text"


def test_stateless_fields_are_refused_by_name(url):
    for extra, param in (({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store")):
        with pytest.raises(openai.BadRequestError) as e:
            client(url).responses.create(model="tiny", input=USER, **extra)
        assert e.value.body["param"] == param and "store is false" in e.value.body["message"]
    r = httpx.post(url + "/v1/responses", json={"input": [{"type": "item_reference", "id": "x"}]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_thinking_templates_answer_with_a_reasoning_item(thinking_rt):
    want_reasoning, want_text = oracle(SCRIPT)
    body = {"model": "t", "input": "Hi!", "max_output_tokens": 120, "temperature": 0}
    with serving(thinking_rt) as s:
        r = client(s.url).responses.create(**body)
        assert [o.type for o in r.output] == ["reasoning", "message"]
        assert (r.output[0].content[0].text, r.output_text) == (want_reasoning, want_text)
        with client(s.url).responses.stream(**body) as st:
            events = list(st)
            final = st.get_final_response()
        assert [o.type for o in final.output] == ["reasoning", "message"]
        pieces = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert len(pieces) > 1 and "".join(pieces) == want_reasoning
        # the reasoning text is a content part of its item, opened and closed as a message's is
        parts = [(e.type, e.part.type) for e in events if e.type.startswith("response.content_part.")]
        assert parts == [("response.content_part.added", "reasoning_text"), ("response.content_part.done", "reasoning_text"),
                         ("response.content_part.added", "output_text"), ("response.content_part.done", "output_text")]
        assert final.output_text == want_text
