"""Anthropic's Messages API on `edgekv serve`, through the official anthropic client, on the tiny
bundle: the same prompt through /v1/chat/completions and /v1/messages gives the same tokens at
temperature 0 (one engine underneath); the stream's events in Anthropic's order and reassembling
to the whole reply; stop sequences; a tool round trip (tool_use out, tool_result in) against the
chat API's; count_tokens; thinking blocks; x-api-key; Anthropic-shaped errors."""
from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
import httpx  # noqa: E402

from tests.serving import greedy_chat, serving, tools_url, url  # noqa: E402, F401  (url, tools_url: fixtures)
from tests.test_reasoning import SCRIPT, oracle, thinking_rt  # noqa: E402, F401  (the scripted thinking model)

SYSTEM = "The capital of France is Paris."
USER = "Tell me about robots and trains."
# this anthropic client takes no sampling fields (newer Claude models set their own): sent as extra fields,
# which edgekv reads as the chat API does
GREEDY = {"extra_body": {"temperature": 0}}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "boolean"}},
        "required": ["city", "days"], "additionalProperties": False}




def claude(url, key="none"):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


def test_messages_give_the_chat_apis_greedy_tokens(url):
    want = greedy_chat(url, {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                      "max_tokens": 24})
    m = claude(url).messages.create(model="tiny", max_tokens=24, **GREEDY, system=SYSTEM,
                                    messages=[{"role": "user", "content": USER}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want["choices"][0]["message"]["content"]
    u = want["usage"]
    assert m.usage.output_tokens == u["completion_tokens"]
    # Anthropic counts cached prompt tokens apart: together they are the whole prompt
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == u["prompt_tokens"]
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want["choices"][0]["finish_reason"]]
    # system as text blocks, content as text blocks: the same prompt
    m2 = claude(url).messages.create(model="tiny", max_tokens=24, **GREEDY,
                                     system=[{"type": "text", "text": SYSTEM}],
                                     messages=[{"role": "user", "content": [{"type": "text", "text": USER}]}])
    assert m2.content[0].text == m.content[0].text and m2.usage.output_tokens == m.usage.output_tokens


def test_the_stream_is_anthropics_event_sequence_and_the_whole_reply(url):
    body = {"model": "tiny", "max_tokens": 24, "messages": [{"role": "user", "content": USER}]}
    whole = claude(url).messages.create(**body, **GREEDY)
    with claude(url).messages.stream(**body, **GREEDY) as st:
        text = "".join(st.text_stream)
        final = st.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    with httpx.stream("POST", url + "/v1/messages", json={**body, "temperature": 0, "stream": True}, timeout=120) as r:
        lines = [x for x in r.iter_lines() if x]
    names = [x[7:] for x in lines if x.startswith("event: ")]
    data = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
    assert [d["type"] for d in data] == names  # each event's name is its data's type
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert data[0]["message"]["content"] == [] and data[0]["message"]["stop_reason"] is None
    assert data[-2]["delta"]["stop_reason"] == whole.stop_reason
    assert data[-2]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_stop_sequences_cut_the_text_and_are_named(url):
    body = {"model": "tiny", "max_tokens": 24, "messages": [{"role": "user", "content": USER}], **GREEDY}
    full = claude(url).messages.create(**body).content[0].text
    stop = full[5:8]
    assert stop and stop not in full[:5] + full[5:7]
    m = claude(url).messages.create(**body, stop_sequences=[stop])
    assert m.content[0].text == full[: full.find(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    with claude(url).messages.stream(**body, stop_sequences=[stop]) as st:
        final = st.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == m.content[0].text


TOOLS = [{"name": "weather", "description": "the weather in a city", "input_schema": CITY}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                                  "parameters": CITY}}]


def test_a_tool_round_trip_is_the_chat_apis(tools_url):
    c = claude(tools_url)
    msgs = [{"role": "user", "content": USER}]
    m = c.messages.create(model="tiny", max_tokens=160, **GREEDY, messages=msgs, tools=TOOLS,
                          tool_choice={"type": "tool", "name": "weather"})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert use.name == "weather" and use.input["city"] in ("Paris", "Rome") and isinstance(use.input["days"], bool)
    assert use.id.startswith("toolu_")
    # the chat API, asked the same, calls the same
    want = greedy_chat(tools_url, {"messages": msgs, "tools": OPENAI_TOOLS, "max_tokens": 160,
                            "tool_choice": {"type": "function", "function": {"name": "weather"}}})
    call = want["choices"][0]["message"]["tool_calls"][0]["function"]
    assert json.loads(call["arguments"]) == use.input and want["usage"]["prompt_tokens"] == (
        m.usage.input_tokens + m.usage.cache_read_input_tokens)
    # streamed: the input_json_delta pieces are the same input
    with c.messages.stream(model="tiny", max_tokens=160, **GREEDY, messages=msgs, tools=TOOLS,
                           tool_choice={"type": "tool", "name": "weather"}) as st:
        final = st.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == use.input
    # the result goes back: the same conversation as the chat API's tool messages, the same reply
    back = msgs + [{"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": "weather",
                                                      "input": use.input}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    r = c.messages.create(model="tiny", max_tokens=12, **GREEDY, messages=back, tools=TOOLS)
    oai = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"}]
    again = greedy_chat(tools_url, {"messages": oai, "tools": OPENAI_TOOLS, "max_tokens": 12})
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == again["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == again["usage"]["completion_tokens"]
    text = "".join(b.text for b in r.content if b.type == "text")
    assert text == (again["choices"][0]["message"]["content"] or "")
    # a tool_result for a call never made is refused, Anthropic-shaped
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_count_tokens_is_the_prompt_messages_create_sends(url, rt_int8):
    c = claude(url)
    msgs = [{"role": "user", "content": USER}]
    n = c.messages.count_tokens(model="tiny", system=SYSTEM, messages=msgs)
    assert n.input_tokens == len(rt_int8.codec.chat_ids([{"role": "system", "content": SYSTEM}] + msgs))
    m = c.messages.create(model="tiny", max_tokens=2, system=SYSTEM, messages=msgs)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n.input_tokens


def test_errors_are_anthropic_shaped(url, rt_int8):
    c = claude(url)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.body["error"]["message"]
    r = httpx.post(url + "/v1/messages", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {  # required, as Anthropic's
        "type": "invalid_request_error", "message": "'max_tokens' is required"}}
    for bad, said in (({"role": "system", "content": "x"}, "role of user or assistant"),
                      ({"role": "user", "content": [{"type": "image", "source": {}}]}, "'image'")):
        r = httpx.post(url + "/v1/messages", json={"max_tokens": 2, "messages": [bad]}, timeout=60)
        assert r.status_code == 400 and r.json()["type"] == "error" and said in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/messages/nope", json={}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(url + "/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
                   headers={"anthropic-version": "yesterday"}, timeout=60)
    assert r.status_code == 400 and "anthropic-version" in r.json()["error"]["message"]
    # the chat API's errors keep OpenAI's shape
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_x_api_key_is_a_key(rt_int8):
    with serving(rt_int8, api_keys=["k1"]) as s:
        m = claude(s.url, "k1").messages.create(model="tiny", max_tokens=2, **GREEDY,
                                               messages=[{"role": "user", "content": "hi"}])
        assert m.usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError) as e:
            claude(s.url, "wrong").messages.create(model="tiny", max_tokens=2,
                                                   messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
        # (this client sends the key as Bearer too): x-api-key alone, as other Anthropic clients send it
        body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for key, status in (("k1", 200), ("wrong", 401)):
            r = httpx.post(s.url + "/v1/messages", json=body, headers={"x-api-key": key}, timeout=60)
            assert r.status_code == status, r.text
        assert r.json()["error"]["type"] == "authentication_error"
        # Bearer still works, and the OpenAI client keeps OpenAI's error shape
        oai = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e2:
            oai.models.list()
        assert e2.value.body["type"] == "authentication_error" and e2.value.body["code"] == "invalid_api_key"


def test_thinking_templates_answer_in_thinking_and_text_blocks(thinking_rt):
    want_reasoning, want_text = oracle(SCRIPT)
    body = {"model": "t", "max_tokens": 120, "messages": [{"role": "user", "content": "Hi!"}], **GREEDY,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    with serving(thinking_rt) as s:
        m = claude(s.url).messages.create(**body)
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert (m.content[0].thinking, m.content[1].text) == (want_reasoning, want_text)
        with claude(s.url).messages.stream(**body) as st:
            events = list(st)
            final = st.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert (final.content[0].thinking, final.content[1].text) == (want_reasoning, want_text)
        deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
        assert deltas.count("thinking_delta") > 1  # streamed in pieces, not at the end
        # thinking disabled, or not asked for (Anthropic's default): the template's empty <think></think>
        # pre-filled, a longer prompt, and no thinking block
        unasked = {k: v for k, v in body.items() if k != "thinking"}
        for off in (claude(s.url).messages.create(**unasked, thinking={"type": "disabled"}),
                    claude(s.url).messages.create(**unasked)):
            assert off.usage.input_tokens + off.usage.cache_read_input_tokens == len(
                thinking_rt.codec.chat_ids(body["messages"], enable_thinking=False))
            assert "thinking" not in [b.type for b in off.content]


def test_the_loading_gate_answers_messages_in_anthropics_shape():
    """Before the model is loaded the gate answers every path 503; /v1/messages Anthropic-shaped."""
    import asyncio

    from edgekv.serve.listen import Gate

    def call(path):
        sent = []

        async def send(m):
            sent.append(m)

        asyncio.run(Gate()({"type": "http", "path": path}, None, send))
        return sent[0]["status"], json.loads(sent[1]["body"])

    status, body = call("/v1/messages")
    assert status == 503 and body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    status, body = call("/v1/chat/completions")
    assert status == 503 and body["error"]["code"] == "loading"


def test_a_final_assistant_turn_is_continued(url, rt_int8):
    """Anthropic's prefill: a conversation that ends in an assistant turn goes on from it. At
    temperature 0 the reply is what /v1/completions gives for the template's prompt with the
    prefill appended (the same tokens through the same engine)."""
    msgs = [{"role": "user", "content": USER}]
    prefill = "Robots and trains"
    r = httpx.post(url + "/v1/completions", json={"prompt": rt_int8.codec.render(msgs) + prefill, "max_tokens": 12,
                                                  "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    want = r.json()["choices"][0]
    m = claude(url).messages.create(model="tiny", max_tokens=12, **GREEDY,
                                    messages=msgs + [{"role": "assistant", "content": prefill}])
    got = m.content[0].text if m.content else ""
    assert got == want["text"][: len(got)] and (m.stop_reason != "max_tokens" or got == want["text"])
    # a prefill under a grammar, or after tool_use, cannot be continued: one 400 naming it
    for last in ({"role": "assistant", "content": "{"},
                 {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "weather", "input": {}}]}):
        body = {"max_tokens": 8, "messages": msgs + [last],
                "output_config": {"format": {"type": "json_schema", "schema": CITY}}}
        r = httpx.post(url + "/v1/messages", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text


def test_structured_outputs_hold_the_reply_to_the_schema(url):
    """output_config.format (and the beta's output_format) json_schema: the reply is JSON that
    validates, as response_format holds a chat reply."""
    jsonschema = pytest.importorskip("jsonschema")
    for field in ({"output_config": {"format": {"type": "json_schema", "schema": CITY}}},
                  {"output_format": {"type": "json_schema", "schema": CITY}}):
        r = httpx.post(url + "/v1/messages", json={"max_tokens": 64, "temperature": 0, **field,
                                                   "messages": [{"role": "user", "content": "A city?"}]}, timeout=120)
        assert r.status_code == 200, r.text
        m = r.json()
        assert m["stop_reason"] == "end_turn", m
        jsonschema.validate(json.loads(m["content"][0]["text"]), CITY)
    r = httpx.post(url + "/v1/messages", json={"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                                               "output_config": {"format": {"type": "text"}}}, timeout=60)
    assert r.status_code == 400 and "output_config" in r.json()["error"]["message"]


@pytest.mark.parametrize("field", ["container", "mcp_servers"])
def test_fields_that_would_change_the_answer_are_refused_by_name(url, field):
    r = httpx.post(url + "/v1/messages", json={"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                                               field: {"id": "x"} if field == "container" else [{"name": "x"}]},
                   timeout=60)
    assert r.status_code == 400 and f"'{field}' is not supported" in r.json()["error"]["message"], r.text
