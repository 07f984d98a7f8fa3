"""`edgekv serve` with issue 26's pieces wired in: response_format (json_object, json_schema, the
openai client's parse), tools (required / named tool_choice, streamed deltas, a tool message
round trip), logprobs against a log-softmax of the plain generator's logits, 400s for what cannot
be enforced, and a constrained request batched with a free one answering as each alone."""
from __future__ import annotations

import asyncio
import json
from typing import Literal

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
import httpx  # noqa: E402
import pydantic  # noqa: E402

from edgekv.runtime.assemble import open_runtime  # noqa: E402
from tests.serving import built, serving  # noqa: E402
from tests.stream_reference import reference


MSGS = [{"role": "user", "content": "Tell me about robots and trains."}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["robot", "train"]}},
          "required": ["ok", "kind"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "boolean"}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {},
                                                                   "additionalProperties": False}}}]
GREEDY = {"temperature": 0, "max_tokens": 120}


@pytest.fixture(scope="module")
def rt(rt_int8):
    return rt_int8  # conftest's tiny int8 runtime


@pytest.fixture(scope="module")
def real_url(real_bundle_int4):
    """The default model: a tools prompt does not fit the tiny bundles' 256 tokens."""
    with open_runtime(real_bundle_int4, ctx=1024, backend="ort-cpu", threads=2) as r, serving(r, capacity=1024) as s:
        yield s.url


@pytest.fixture(scope="module")
def url(rt):
    with serving(rt) as s:
        yield s.url


def post(url, body, path="/v1/chat/completions"):
    return httpx.post(url + path, json=body, timeout=120)


def stream_chunks(url, body, path="/v1/chat/completions"):
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as s:
        return [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]


def streamed_text(chunks):
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest.mark.parametrize("rf,schema", [
    ({"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}, SCHEMA),
    ({"type": "json_object"}, {"type": "object"}),
])
def test_response_format_replies_validate_whole_and_streamed(url, rf, schema):
    body = {"messages": MSGS, "response_format": rf, "temperature": 1, "seed": 5, "max_tokens": 200}
    r = post(url, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    chunks = stream_chunks(url, body)
    jsonschema.validate(json.loads(streamed_text(chunks)), schema)
    assert streamed_text(chunks) == choice["message"]["content"]  # same seed, same reply


def test_openai_client_parse_with_a_pydantic_model(url):
    class Answer(pydantic.BaseModel):
        ok: bool
        kind: Literal["robot", "train"]

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    done = client.beta.chat.completions.parse(model="m", messages=MSGS, response_format=Answer, max_tokens=200,
                                              temperature=0)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Answer) and parsed.kind in ("robot", "train")


@pytest.mark.slow
@pytest.mark.parametrize("choice,name", [("required", None), ({"type": "function", "function": {"name": "weather"}},
                                                               "weather")])
def test_tool_calls_validate_and_stream_to_the_same_reply(real_url, choice, name):
    url = real_url
    body = {"messages": MSGS, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False, **GREEDY}
    r = post(url, body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls"
    calls = c["message"]["tool_calls"]
    assert len(calls) == 1 and (name is None or calls[0]["function"]["name"] == name)
    fn = calls[0]["function"]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[fn["name"]]
    jsonschema.validate(json.loads(fn["arguments"]), params)
    # the streamed deltas reassemble to the same call
    chunks = stream_chunks(url, body)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    got: dict = {}
    for ch in chunks:
        for d in ch["choices"][0]["delta"].get("tool_calls") or []:
            slot = got.setdefault(d["index"], {"name": "", "arguments": ""})
            slot["name"] += d.get("function", {}).get("name") or ""
            slot["arguments"] += d.get("function", {}).get("arguments") or ""
    assert [got[i] for i in sorted(got)] == [{"name": fn["name"], "arguments": fn["arguments"]}]


GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_greedy_tool_calls_end_with_the_list_not_at_max_tokens(real_url, choice):
    """Issue 43: greedy SmolLM2-135M under required (parallel calls allowed) repeated
    get_weather(Paris) until max_tokens (7 calls in 300 tokens, finish_reason length). The list
    ends: distinct calls only, finish_reason tool_calls, streamed the same."""
    body = {"messages": [{"role": "user", "content": "What is the weather like in Paris today?"}],
            "tools": [GET_WEATHER], "tool_choice": choice, "temperature": 0, "max_tokens": 300}
    r = post(real_url, body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    if choice == "auto" and not c["message"].get("tool_calls"):
        pytest.skip("the model answered in text under auto")
    calls = [(x["function"]["name"], x["function"]["arguments"]) for x in c["message"]["tool_calls"]]
    assert c["finish_reason"] == "tool_calls" and len(set(calls)) == len(calls) >= 1, (c["finish_reason"], calls)
    assert r.json()["usage"]["completion_tokens"] < 300
    chunks = stream_chunks(real_url, body)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    names = [d["function"]["name"] for ch in chunks for d in ch["choices"][0]["delta"].get("tool_calls") or []
             if d.get("function", {}).get("name")]
    assert names == [n for n, _ in calls]


def test_a_reply_that_could_not_close_within_max_tokens_is_a_400(url):
    schema = {"type": "object", "properties": {"k": {"const": "x" * 3000}}, "required": ["k"]}
    body = {"messages": MSGS, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}}
    r = post(url, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "could not close" in r.json()["error"]["message"]


@pytest.mark.slow
def test_a_tool_result_round_trip_is_accepted(real_url):
    url = real_url
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = post(url, {"messages": msgs, "tools": TOOLS, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    r = post(url, {"messages": MSGS + [{"role": "tool", "tool_call_id": "nope", "content": "x"}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def test_logprobs_are_the_log_softmax_of_the_plain_generators_logits(rt, url):
    n = 6
    r = post(url, {"messages": MSGS, "logprobs": True, "top_logprobs": 3, "temperature": 0, "max_tokens": n})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    g = reference(rt, capacity=256)
    logits = g.prefill(rt.codec.chat_ids(MSGS))
    for entry in content:
        lp = log_softmax(logits)
        t = int(np.argmax(lp))
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]  # greedy: the most likely token
        assert entry["logprob"] == pytest.approx(lp[t], abs=2e-3)
        want = np.argsort(-lp, kind="stable")[:3]
        assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(lp[want].tolist(), abs=2e-3)
        logits = g.decode_step(t)
    assert len(content) >= 1
    r = post(url, {"prompt": "robots", "logprobs": 2, "temperature": 0, "max_tokens": 3}, "/v1/completions")
    lp = r.json()["choices"][0]["logprobs"]
    assert r.status_code == 200 and len(lp["token_logprobs"]) == len(lp["tokens"]) == 3
    assert all(len(t) == 2 for t in lp["top_logprobs"])


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "string", "format": "uri-reference"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "enum": ["x" * 1000 + str(i) for i in range(40)]}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"n": 2}, "n"),
])
def test_what_cannot_be_enforced_is_a_400(url, body, param):
    r = post(url, {"messages": MSGS, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_without_the_bundle_structured_fields_are_a_400_and_plain_chat_works(rt):
    with serving(rt, with_bundle=False) as (_, _, u):
        r = post(u, {"messages": MSGS, "max_tokens": 2, "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and "bundle" in r.json()["error"]["message"]
        assert post(u, {"messages": MSGS, "max_tokens": 2}).status_code == 200


def test_include_usage_sends_a_last_chunk_with_the_usage(url):
    chunks = stream_chunks(url, {"messages": MSGS, "max_tokens": 4, "temperature": 0,
                                 "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1


def test_a_constrained_request_batched_with_a_free_one_answers_as_each_alone(url):
    free = {"messages": MSGS, **GREEDY, "max_tokens": 40}
    shaped = {"messages": MSGS, **GREEDY, "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "r", "schema": SCHEMA}}}
    alone = [post(url, free).json(), post(url, shaped).json()]

    async def together():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(url + "/v1/chat/completions", json=b) for b in (free, shaped)))

    both = [r.json() for r in asyncio.run(together())]
    for a, b in zip(alone, both):
        assert a["choices"][0]["message"] == b["choices"][0]["message"]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]


def test_constrained_logprobs_are_of_the_masked_distribution(rt, url):
    """A json_object reply's first token: the grammar forbids most of the vocabulary, so its
    logprob under the masked distribution is above its log-softmax over all the logits (the
    plain generator's), and no alternative is one the grammar forbids (all finite)."""
    r = post(url, {"messages": MSGS, "response_format": {"type": "json_object"}, "logprobs": True,
                   "top_logprobs": 5, "temperature": 0, "max_tokens": 3})
    first = r.json()["choices"][0]["logprobs"]["content"][0]
    g = reference(rt, capacity=256)
    lp = log_softmax(g.prefill(rt.codec.chat_ids(MSGS)))
    from edgekv.runtime.grammar_tokenizer import tokenizer_for
    ll = tokenizer_for(rt.bundle).ll
    ids = [i for i in range(lp.shape[0]) if list(ll.decode_bytes([i])) == first["bytes"]]
    assert ids and first["logprob"] > max(lp[i] for i in ids) + 1e-3
    assert len(first["top_logprobs"]) >= 1 and all(np.isfinite(e["logprob"]) for e in first["top_logprobs"])


def test_the_server_edgekv_serve_builds_enforces_response_format(rt):
    """`edgekv serve` builds its Server with build_server: that one must carry the bundle, or every
    structured request is a 400 in the product while the tests above pass."""
    with built(rt, ctx=256, parallel=2, prefill_chunk=32) as s:
        r = post(s.url, {"messages": MSGS, **GREEDY, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    reply = r.json()["choices"][0]
    assert reply["finish_reason"] == "stop"
    assert isinstance(json.loads(reply["message"]["content"]), dict)
