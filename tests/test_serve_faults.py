"""Issue 41, every fault ends in one clear line: a drain that runs out of time ends each reply it
cuts with an error saying so (a streamed one: an SSE error event, then [DONE]; a whole one: a 503)
and the access line says `cut`; /health while draining or loading is a 503 with Retry-After; a
schema the grammar engine cannot build is a 400 naming why, refused before the request takes any
KV cell (a regex that spells out a million characters, a $ref that is only itself, a cycle of
them), and the schema nesting limit counts the levels its author wrote (32 nested objects pass)."""
from __future__ import annotations

import json
import signal
import threading
import time

import pytest

for _m in ("starlette", "uvicorn", "prometheus_client"):
    pytest.importorskip(_m)
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from edgekv.runtime.grammar_build import MAX_JSON_DEPTH, MAX_SCHEMA_DEPTH, json_schema, regex  # noqa: E402
from edgekv.runtime.grammar_engine import GrammarError  # noqa: E402
from tests.serving import serving  # noqa: E402
from tests.test_serve_lifecycle import MSGS, WAIT, serve  # noqa: E402,F401  (serve: the subprocess fixture)


# -- (a) the drain ---------------------------------------------------------------------------------

def test_a_drain_that_runs_out_ends_each_cut_reply_with_an_error(serve):
    """`--drain-seconds 2` with a long stream and a whole request the engine never finishes:
    SIGTERM, and when the time is up the stream's last events are an SSE error naming the drain
    and [DONE], the whole request gets a 503 JSON error, the access lines say `cut`, exit 0."""
    s = serve("--drain-seconds", 2)
    s.state("ready")
    s.hold_engine_after(0)  # both requests queue before the engine takes a step
    t, lines = s.stream({"messages": MSGS, "max_tokens": 400, "temperature": 0})
    whole = {}
    w = threading.Thread(target=lambda: whole.setdefault("r", s.post({"messages": MSGS, "max_tokens": 400})),
                         daemon=True)
    w.start()
    s.until(lambda: s.health().json()["waiting"] == 2, "both requests queued")
    s.hold_engine_after(3)  # admit and prefill both, two decode steps: then held mid-reply
    s.until(lambda: s.held() and s.health().json()["active"] == 2, "both replies running, held")
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait() == 0
    t.join(WAIT)
    w.join(WAIT)
    assert lines[-1] == "[DONE]", lines[-3:]
    error = json.loads(lines[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "server_shutting_down"
    assert "--drain-seconds 2" in error["message"] and "cut" in error["message"]
    assert all("error" not in json.loads(x) for x in lines[:-2])  # the text came before, as chunks
    r = whole["r"]
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    err = s.stderr()
    assert "2 requests still running after 2 s were cut" in err and "Traceback" not in err
    assert "POST /v1/chat/completions 200 cut prompt=" in err  # the stream: its 200 went out first
    assert "POST /v1/chat/completions 503 cut prompt=" in err


@pytest.fixture(scope="module")
def rt(rt_int8):
    return rt_int8


def test_health_while_draining_or_loading_says_when_to_retry(rt):
    """docs/serve.md: /health and new requests get 503 with Retry-After while draining (and loading)."""
    with serving(rt) as (server, _, url):
        assert "retry-after" not in httpx.get(url + "/health", timeout=30).headers
        for state in ("draining", "loading"):
            server.set_state(state)
            r = httpx.get(url + "/health", timeout=30)
            assert r.status_code == 503 and r.json()["state"] == state
            assert r.headers["retry-after"] == "1"
            r = httpx.post(url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}, timeout=30)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"


def test_a_reply_cut_in_process_ends_with_an_error_event_and_done(rt):
    """The same cut without a subprocess: a stream held by a paused engine, cut, ends with the SSE
    error event and [DONE]; a request prepared after the cut is a 503 before it takes any cell."""
    with serving(rt) as (server, batcher, url):
        batcher.pause()
        lines, done = [], threading.Event()

        def run():
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=WAIT,
                              json={"messages": MSGS, "max_tokens": 50, "stream": True}) as r:
                lines.extend(x[6:] for x in r.iter_lines() if x.startswith("data: "))
            done.set()
        threading.Thread(target=run, daemon=True).start()
        deadline = time.monotonic() + WAIT
        while not len(server.live) and time.monotonic() < deadline:
            done.wait(0.02)
        assert server.live.cut("cut for the test") == 1
        assert done.wait(WAIT)
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["message"] == "cut for the test"
        waiting = batcher.stats()["waiting"]  # the cut one, until the engine's next step drops it
        r = httpx.post(url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        assert batcher.stats()["waiting"] == waiting  # refused before it reached the engine
        batcher.pause(False)


# -- (b) schemas the grammar cannot build ----------------------------------------------------------

def nested(n: int) -> dict:
    """n objects, each the one required property of the one before."""
    s = {"type": "string"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"], "additionalProperties": False}
    return s


CYCLE = {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}
TREE = {"$defs": {"N": {"type": "object", "properties": {"v": {"type": "integer"},
                                                          "kids": {"type": "array", "items": {"$ref": "#/$defs/N"}}},
                        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/N"}


def rf(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}


@pytest.fixture(scope="module")
def served(rt):
    with serving(rt) as s:
        yield s


def chat(url, **body):
    return httpx.post(url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8, **body}, timeout=120)


@pytest.mark.parametrize("schema, said", [
    ({"type": "string", "pattern": "^(a{1000}){1000}$"}, "matches nothing shorter than 1000000 characters"),
    ({"$ref": "#"}, "recursive $ref # -> # is not supported"),
    (CYCLE, "recursive $ref #/$defs/B -> #/$defs/A -> #/$defs/B is not supported"),
    ({"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}, "the schema requires a value inside itself"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "(a{1,1000}){1000}"}},
      "required": ["s"]}, "the pattern '(a{1,1000}){1000}' is too large"),
])
def test_a_schema_the_grammar_cannot_build_is_a_400_before_any_cell(served, schema, said):
    """Each was a 500 "generation failed" after the request had been queued (llguidance's errors
    come when the matcher first runs); now a 400 with the reason, the engine never asked."""
    before = served.batcher.stats()["requests"]
    r = chat(served.url, response_format=rf(schema))
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert said in e["message"] and e["param"] == "response_format" and "\n" not in e["message"]
    assert served.batcher.stats()["requests"] == before


def test_a_tool_whose_parameters_cannot_be_built_is_a_400(served):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "^(a{1000}){1000}$"}}}}}]
    r = chat(served.url, tools=tools, tool_choice="required")
    assert r.status_code == 400 and "1000000 characters" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "tools"


def test_the_openai_client_hears_the_reason(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="recursive"):
        client.chat.completions.create(model="m", messages=MSGS, max_tokens=4, response_format=rf({"$ref": "#"}))


def test_schema_nesting_counts_the_levels_its_author_wrote(served):
    """32 nested objects were refused as "deeper than 64 levels" (64 levels of JSON); they pass, and
    a schema past the limit is refused naming its own count against it."""
    r = chat(served.url, response_format=rf(nested(32)), max_tokens=64)  # its shortest reply fits
    assert r.status_code == 200, r.text
    deep = MAX_SCHEMA_DEPTH + 1
    r = chat(served.url, response_format=rf(nested(deep)))
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert f"deeper than {MAX_SCHEMA_DEPTH} levels" in msg and f"{deep} levels deep" in msg
    from edgekv.runtime.grammar_checks import schema_levels
    assert schema_levels(nested(32)) == 32


def test_recursion_through_a_property_is_served(served):
    """A tree ($ref back to itself inside an array of kids) is recursion llguidance supports: the
    refusals above name only a $ref that is nothing but itself (a guard: this was served before)."""
    r = chat(served.url, response_format=rf(TREE), temperature=0)
    assert r.status_code == 200, r.text
    from edgekv.runtime.grammar_checks import ref_cycle
    assert ref_cycle(TREE) is None


@pytest.mark.parametrize("pattern, shortest", [
    ("^(a{1000}){1000}$", 10 ** 6), ("(a{1000}){1,1000}", 1000), ("a{0,300000}", 0), ("(a{1000}|b){1000}", 1000),
    (r"\d{3}-\d{4}", 8), ("(?P<x>ab)c|d", 1), ("(?=a)b", 1), ("[]a]{2}", 2), (r"\p{L}{4}", 4), ("(ab", 2),
])
def test_regex_min_chars(pattern, shortest):
    from edgekv.runtime.grammar_checks import regex_min_chars
    assert regex_min_chars(pattern) == shortest


def test_the_regex_flag_and_deep_values_are_refused_by_name():
    with pytest.raises(GrammarError, match="1000000 characters"):
        regex("(a{1000}){1000}")
    value = 1
    for _ in range(MAX_JSON_DEPTH):
        value = [value]
    with pytest.raises(GrammarError, match=f"deeper than {MAX_JSON_DEPTH} levels of JSON"):
        json_schema({"const": value})
