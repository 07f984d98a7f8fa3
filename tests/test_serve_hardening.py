"""`edgekv serve`'s HTTP layer against hostile and careless clients (issue 22): hung-up clients
are cancelled, bodies and texts are bounded before they cost anything, the template and the
tokenizer run off the event loop, local binds check Host, POSTs must be JSON, several API keys
with their prefixes kept apart, every bad input an OpenAI-style error, unsupported fields refused
by name, /health states, the access log, and stop strings that hold back only what could still
become a stop."""
import asyncio
import json
import logging
import socket
import threading
import time
import pytest

for _m in ("starlette", "uvicorn", "prometheus_client"):
    pytest.importorskip(_m)
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgekv.serve.app import STATES, Server  # noqa: E402
from edgekv.serve.fields import encode_unlocked, max_token_chars  # noqa: E402
from edgekv.serve.stops import StopText  # noqa: E402
from tests import serving as served_by  # noqa: E402

MSGS = [{"role": "system", "content": "The capital of France is Paris."},
        {"role": "user", "content": "Tell me about robots and trains."}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def rt(rt_int8):
    return rt_int8  # conftest's tiny int8 runtime


def serving(rt, codec=None, parallel=4, max_queue=64, **server_kw):
    """A Server without the bundle over a fresh engine (256 cells), served on 127.0.0.1:
    (server, engine, url)."""
    return served_by.serving(rt, codec, with_bundle=False, parallel=parallel, max_queue=max_queue, **server_kw)


@pytest.fixture(scope="module")
def served(rt):
    with serving(rt) as s:
        yield s


def chat(url, body, **kw):
    return httpx.post(url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body},
                      timeout=60, **kw)


def raw_post(url, body: bytes, path="/v1/chat/completions", headers=JSON):
    return httpx.post(url + path, content=body, headers=headers, timeout=60)


def wait_for(cond, what: str, limit_s: float = 30):
    """Poll until cond() (the limit only stops a hang; nothing here is timed)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def is_openai_error(r, status: int, param=None) -> bool:
    e = r.json()["error"]
    return r.status_code == status and e["message"] and e["type"] and (param is None or e["param"] == param)


class BlockingCodec:
    """The tiny bundle's codec whose chat template render waits until released (and counts)."""

    def __init__(self, codec, block: bool):
        self.codec, self.renders = codec, 0
        self.started, self.release = threading.Event(), threading.Event()
        if not block:
            self.release.set()

    def __getattr__(self, name):
        return getattr(self.codec, name)

    def render(self, messages, add_generation_prompt=True):
        self.renders += 1
        self.started.set()
        assert self.release.wait(60)
        return self.codec.render(messages, add_generation_prompt)


# -- 1. cancel on disconnect, streaming or not
def test_non_streaming_clients_that_hang_up_are_cancelled(rt):
    """Four non-streaming clients queued behind a paused engine hang up: each of their requests
    is cancelled (before: they stayed, and held every slot once admitted), and the next client
    is served."""
    with serving(rt, parallel=1) as (server, engine, url):
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"messages": MSGS, "max_tokens": 200}).encode()
        engine.pause()
        socks = []
        for _ in range(4):
            s = socket.create_connection((host, int(port)))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            socks.append(s)
        wait_for(lambda: engine.stats()["waiting"] == 4, "four requests waiting")
        reqs = list(engine.waiting)
        assert not any(r.cancelled for r in reqs)
        for s in socks:
            s.close()
        wait_for(lambda: all(r.cancelled for r in reqs), "the hung-up clients' requests cancelled")
        engine.pause(False)
        r = chat(url, {"max_tokens": 2, "temperature": 0})
        assert r.status_code == 200
        assert all(q.finish_reason == "cancelled" for q in reqs)
        assert engine.counters["requests"] == 1  # only the live client's was ever admitted
        assert "edgekv_client_disconnects_total 4.0" in httpx.get(url + "/metrics", timeout=30).text


# -- 2. body size, text length, work off the event loop
def padded_body(size: int) -> bytes:
    """A valid chat request of exactly `size` bytes (JSON whitespace as padding)."""
    b = json.dumps({"messages": MSGS, "max_tokens": 2, "temperature": 0}).encode()
    assert len(b) < size
    return b[:-1] + b" " * (size - len(b)) + b"}"


def test_body_limit_by_length_and_while_reading(rt):
    with serving(rt, max_body_bytes=2000) as (server, engine, url):
        assert raw_post(url, padded_body(2000)).status_code == 200
        r = raw_post(url, padded_body(2001))
        assert is_openai_error(r, 413) and r.json()["error"]["code"] == "body_too_large" and "2000" in r.text
        # chunked (no Content-Length): counted while it arrives
        body = padded_body(3000)
        r = httpx.post(url + "/v1/chat/completions", content=iter([body[:1500], body[1500:]]), headers=JSON,
                       timeout=60)
        assert "content-length" not in r.request.headers and is_openai_error(r, 413)
        # a Content-Length past the limit is refused before any of the body is sent
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000000000\r\n\r\n")
            assert s.recv(200).startswith(b"HTTP/1.1 413")
        assert httpx.get(url + "/health", timeout=30).status_code == 200


def test_default_body_limit_is_one_mib(served):
    _, _, url = served
    r = raw_post(url, padded_body((1 << 20) + 1))
    assert is_openai_error(r, 413) and str(1 << 20) in r.text


@given(st.text(alphabet="abc é東🙂\n Paris robots", max_size=300))
@settings(max_examples=150, deadline=None)
def test_token_chars_bound_holds(rt, text):
    """The text-length bound is sound: no text tokenizes to fewer than len(text) / K tokens."""
    assert len(rt.codec.encode(text)) * max_token_chars(rt.codec) >= len(text)


def test_text_far_longer_than_the_context_is_refused_before_tokenizing(rt):
    codec = BlockingCodec(rt.codec, block=False)
    with serving(rt, codec=codec) as (server, engine, url):
        assert server.max_chars == engine.limit * max_token_chars(rt.codec)
        r = chat(url, {"messages": [{"role": "user", "content": "a" * (server.max_chars + 1)}]})
        assert is_openai_error(r, 413, "messages") and r.json()["error"]["code"] == "context_length_exceeded"
        assert str(engine.limit) in r.json()["error"]["message"] and codec.renders == 0
        r = httpx.post(url + "/v1/completions", json={"prompt": "a" * (server.max_chars + 1)}, timeout=60)
        assert is_openai_error(r, 413, "prompt")
        assert chat(url, {}).status_code == 200 and codec.renders == 1


@given(st.text(alphabet="abc é東🙂\n Paris robots<|im_start|>", max_size=200))
@settings(max_examples=150, deadline=None)
def test_encode_unlocked_is_the_codecs_encode(rt, text):
    assert encode_unlocked(rt.codec, text) == rt.codec.encode(text)


def test_the_tokenizer_lets_the_event_loop_run(rt):
    """While a long text is tokenized on a worker thread another thread (the event loop) runs:
    it gets the interpreter before the tokenizer is half done (Tokenizer.encode holds the GIL to
    the end: the other thread ran only after it returned)."""
    text = "robots trains tea Paris " * 20_000
    started, t = threading.Event(), {}

    def work():
        t["start"] = time.perf_counter()
        started.set()
        encode_unlocked(rt.codec, text)
        t["end"] = time.perf_counter()
    w = threading.Thread(target=work)
    w.start()
    started.wait()
    t["other"] = time.perf_counter()
    w.join()
    assert t["other"] - t["start"] < (t["end"] - t["start"]) / 2


def test_health_answers_while_a_template_renders(rt):
    """The render blocks until released; /health is asked (and answers) while it is blocked. With
    the render on the event loop /health could not answer until the release."""
    codec = BlockingCodec(rt.codec, block=True)
    with serving(rt, codec=codec) as (server, engine, url):
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", chat(url, {})))
        t.start()
        try:
            assert codec.started.wait(30)
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            assert not codec.release.is_set() and "r" not in out  # the render is still blocked
        finally:
            codec.release.set()
            t.join(60)
        assert out["r"].status_code == 200


# -- 3. Host, content type, keys and tenants
@pytest.mark.parametrize("host,ok", [("127.0.0.1", True), ("localhost:9999", True), ("[::1]:8080", True),
                                     ("LocalHost", True), ("evil.example", False), ("evil.example:8080", False),
                                     ("127.0.0.1.evil.example", False), ("[::2]", False)])
def test_a_local_bind_answers_only_local_host_names(served, host, ok):
    _, _, url = served
    for path in ("/v1/models", "/health"):
        r = httpx.get(url + path, headers={"Host": host}, timeout=30)
        assert r.status_code == 200 if ok else is_openai_error(r, 421)
    r = chat(url, {}, headers={"Host": host})
    assert r.status_code == 200 if ok else is_openai_error(r, 421)


def test_a_non_local_bind_answers_any_host(rt):
    with serving(rt, bind_host="0.0.0.0") as (server, engine, url):
        assert httpx.get(url + "/v1/models", headers={"Host": "board.example:8080"}, timeout=30).status_code == 200


@pytest.mark.parametrize("ctype,ok", [("application/json", True), ("application/json; charset=utf-8", True),
                                      ("Application/JSON; charset=UTF-8", True), (None, False),
                                      ("text/plain", False), ("text/plain; charset=utf-8", False),
                                      ("application/x-www-form-urlencoded", False), ("multipart/form-data", False),
                                      ("application/json; charset=latin-1", False)])
def test_post_bodies_must_be_json(served, ctype, ok):
    """A web page's cross-origin 'simple' POST (text/plain, a form, no type) is refused."""
    _, _, url = served
    body = json.dumps({"messages": MSGS, "max_tokens": 2}).encode()
    r = raw_post(url, body, headers={"content-type": ctype} if ctype else {})
    assert r.status_code == 200 if ok else is_openai_error(r, 415)


def test_several_api_keys_each_its_own_tenant(rt):
    with serving(rt, api_keys=["key-one", "key-two"]) as (server, engine, url):
        seen = []
        submit = engine.submit
        engine.submit = lambda req: seen.append(req) or submit(req)
        for key in ("key-one", "key-two", "key-one"):
            assert chat(url, {}, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        for bad in ("key-on", "key-one2", "key-one,key-two", "KEY-ONE", "x"):
            r = chat(url, {}, headers={"Authorization": f"Bearer {bad}"})
            assert is_openai_error(r, 401) and r.json()["error"]["type"] == "authentication_error"
        assert is_openai_error(chat(url, {}), 401)
        a, b, a2 = (r.ask.tenant for r in seen)
        assert a == a2 and a != b and a and b  # stable per key, distinct between keys
        assert "key" not in a + b  # not the key itself
    with serving(rt) as (server, engine, url):
        seen = []
        submit = engine.submit
        engine.submit = lambda req: seen.append(req) or submit(req)
        assert chat(url, {}).status_code == 200 and seen[0].ask.tenant == ""
    with pytest.raises(ValueError):
        Server(engine, rt.codec, "m", api_keys=["ok", ""])


def test_cached_tokens_come_only_from_the_callers_own_prompts(rt):
    """A prompt that key one sent is cached for key one, not for key two (cached_tokens was a
    side channel that revealed other clients' prompts)."""
    with serving(rt, api_keys=["key-one", "key-two"]) as (server, engine, url):
        def cached(key):
            c = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
            r = c.chat.completions.create(model="m", messages=MSGS, max_tokens=2, temperature=0)
            return r.usage.prompt_tokens_details.cached_tokens
        assert cached("key-one") == 0
        assert cached("key-one") > 0
        assert cached("key-two") == 0
        assert cached("key-two") > 0


# -- 4. every bad input an OpenAI-style error; what OpenAI accepts, accepted
MSG_JSON = json.dumps(MSGS).encode()


@pytest.mark.parametrize("body,param", [
    (b'{"messages": [{"role": "user", "content": "\\udcff"}]}', "messages"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}', "messages"),
    (b'{"messages": ' + MSG_JSON + b', "stop": ["\\udcff"]}', "stop"),
    (b'{"messages": ' + MSG_JSON + b', "max_tokens": ' + b"7" * 5000 + b"}", None),
    (b'{"messages": ' + MSG_JSON + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    (b'{"messages": ' + MSG_JSON + b', "temperature": NaN}', None),
    (b'{"messages": ' + MSG_JSON + b', "seed": 9223372036854775808}', "seed"),
    (b'{"messages": ' + MSG_JSON + b', "seed": -9223372036854775809}', "seed"),
    (b'{"messages": [{"role": "tool", "content": "x"}]}', "messages"),
    (b'\xff\xfe{}', None),
])
def test_bad_input_is_a_json_400(served, body, param):
    _, _, url = served
    assert is_openai_error(raw_post(url, body), 400, param)


def test_bad_completion_prompt_is_a_json_400(served):
    _, _, url = served
    assert is_openai_error(raw_post(url, b'{"prompt": "ab\\udcff"}', path="/v1/completions"), 400, "prompt")


def test_negative_seeds_are_taken(served):
    """Any 64-bit seed, as OpenAI: a negative one is a seed like any other (was a 500)."""
    _, _, url = served
    texts = []
    for seed in (-1, -1, -(1 << 63), 7):
        r = chat(url, {"seed": seed, "temperature": 1.0, "max_tokens": 12})
        assert r.status_code == 200
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1]


def test_nulls_and_the_developer_role_as_openai(served, rt):
    _, _, url = served
    for extra in ({"n": None}, {"stream": None}, {"n": 1, "stream": False}):
        assert chat(url, extra).status_code == 200, extra
    dev = [{"role": "developer", "content": MSGS[0]["content"]}, MSGS[1]]
    a = chat(url, {"messages": dev, "temperature": 0}).json()
    b = chat(url, {"temperature": 0}).json()
    assert a["usage"]["prompt_tokens"] == len(rt.codec.chat_ids(MSGS))  # rendered as the system role
    assert a["choices"][0]["message"] == b["choices"][0]["message"]


def test_the_served_model_name_not_the_clients(served, rt):
    _, _, url = served
    name = rt.bundle.manifest["name"]
    r = chat(url, {"model": "m" * 100_000})
    assert r.status_code == 200 and r.json()["model"] == name
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={"messages": MSGS, "max_tokens": 3, "stream": True, "model": "m" * 100_000}) as s:
        lines = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert lines and all(x["model"] == name for x in lines)


# -- 5. not implemented yet: refused by name
# tools, tool_choice, response_format, logprobs and top_logprobs are served (tests/test_serve_structured.py)
CHAT_REFUSED = [("functions", [{"name": "f"}]), ("function_call", "auto"),
                ("logit_bias", {"5": 10}), ("presence_penalty", 0.5), ("frequency_penalty", -1), ("n", 2),
                ("n", True), ("n", "1")]
COMPLETION_REFUSED = [("echo", True), ("suffix", "x"), ("best_of", 2),
                      ("n", 3), ("logit_bias", {"1": -100}), ("presence_penalty", 1)]


@pytest.mark.parametrize("field,value", CHAT_REFUSED)
def test_unsupported_chat_fields_are_refused_by_name(served, field, value):
    _, _, url = served
    r = chat(url, {field: value})
    assert is_openai_error(r, 400, field) and f"'{field}' is not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize("field,value", COMPLETION_REFUSED)
def test_unsupported_completion_fields_are_refused_by_name(served, field, value):
    _, _, url = served
    r = httpx.post(url + "/v1/completions", json={"prompt": "robots", "max_tokens": 2, field: value}, timeout=60)
    assert is_openai_error(r, 400, field) and f"'{field}' is not supported" in r.json()["error"]["message"]


def test_harmless_values_of_unsupported_fields_are_taken(served):
    _, _, url = served
    harmless = {"tools": [], "tool_choice": "none", "functions": None, "function_call": "none",
                "response_format": {"type": "text"}, "logprobs": False, "top_logprobs": 0, "logit_bias": {},
                "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1, "user": "u", "stream_options": None}
    assert chat(url, harmless).status_code == 200
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": "robots", "max_tokens": 2, "echo": False, "suffix": None, "best_of": 1, "logprobs": None,
        "n": None, "logit_bias": None, "presence_penalty": 0.0})
    assert r.status_code == 200


# -- 6. headers and /health
def test_405_says_allow(served):
    _, _, url = served
    r = httpx.get(url + "/v1/chat/completions", timeout=30)
    assert is_openai_error(r, 405) and "POST" in r.headers["allow"]
    r = httpx.post(url + "/v1/models", timeout=30)
    assert is_openai_error(r, 405) and "GET" in r.headers["allow"]


def test_429_says_retry_after(rt):
    with serving(rt, parallel=1, max_queue=1) as (server, engine, url):
        engine.pause()
        refused, threads = [], []
        for _ in range(3):  # until one is refused (the ones the next step would admit wait too)
            n = engine.stats()["waiting"]
            threads.append(threading.Thread(
                target=lambda: (r := chat(url, {})).status_code == 429 and refused.append(r)))
            threads[-1].start()
            wait_for(lambda: engine.stats()["waiting"] > n or refused, "a request waiting or refused")
            if refused:
                break
        assert refused and is_openai_error(refused[0], 429) and int(refused[0].headers["retry-after"]) >= 1
        engine.pause(False)
        for t in threads:
            t.join(60)


def test_health_reports_an_engine_fault(rt):
    with serving(rt) as (server, engine, url):
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        engine.fault = lambda: "non-finite logits in the last 3 requests"
        r = httpx.get(url + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["status"] != "ok"
        assert r.json()["reason"] == "non-finite logits in the last 3 requests"


def test_health_states(rt):
    with serving(rt) as (server, engine, url):
        assert server.state == "ready"
        for state in STATES:
            server.set_state(state)
            h = httpx.get(url + "/health", timeout=30)
            assert h.json()["state"] == state and (h.status_code == 200) == (state == "ready")
            r = chat(url, {})
            if state == "ready":
                assert r.status_code == 200 and h.json()["status"] == "ok"
            else:
                assert is_openai_error(r, 503) and r.json()["error"]["code"] == f"server_{state}"
                assert h.json()["status"] == state
                r = httpx.post(url + "/v1/completions", json={"prompt": "robots", "max_tokens": 2}, timeout=60)
                assert is_openai_error(r, 503) and r.headers["retry-after"]
            assert httpx.get(url + "/v1/models", timeout=30).status_code == 200
        with pytest.raises(ValueError):
            server.set_state("asleep")


def test_an_unexpected_failure_is_a_json_500(rt):
    class Broken(BlockingCodec):
        def render(self, messages, add_generation_prompt=True):
            raise RuntimeError("template exploded")
    with serving(rt, codec=Broken(rt.codec, block=False)) as (server, engine, url):
        r = chat(url, {})
        assert is_openai_error(r, 500) and r.json()["error"]["type"] == "server_error"
        assert "exploded" not in r.text  # the detail goes to the log, not to the client


# -- 8. access log
def test_one_access_log_line_per_request(served, caplog):
    _, _, url = served
    caplog.set_level(logging.INFO, logger="edgekv.serve")
    r = chat(url, {"max_tokens": 3, "temperature": 0}).json()
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "robots", "max_tokens": 2, "stream": True},
                      timeout=60) as s:
        list(s.iter_lines())
    httpx.get(url + "/nothing", timeout=30)
    wait_for(lambda: len([x for x in caplog.records if x.name == "edgekv.serve"]) >= 3, "three log lines")
    lines = [x.getMessage() for x in caplog.records if x.name == "edgekv.serve"]
    assert len(lines) == 3
    u = r["usage"]
    assert lines[0].startswith(f"POST /v1/chat/completions 200 prompt={u['prompt_tokens']} "
                               f"completion={u['completion_tokens']} ")
    assert lines[1].startswith("POST /v1/completions 200 prompt=") and "completion=2 " in lines[1]
    assert lines[2].startswith("GET /nothing 404 ")
    assert all(line.endswith("s") for line in lines)


# -- 9. stop strings hold back only what could still become one
def streamed(url, stop, n=24):
    body = {"messages": MSGS, "max_tokens": n, "temperature": 0, "stream": True, "stop": stop}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as s:
        chunks = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    return [c["choices"][0]["delta"]["content"] for c in chunks if c["choices"][0]["delta"].get("content")]


def test_a_long_stop_string_keeps_streaming(served):
    _, _, url = served
    plain = streamed(url, None)
    text = "".join(plain)
    assert len(plain) > 3
    c = next(ch for ch in "xqz#~" if ch not in text)
    assert streamed(url, [c * 200]) == plain  # every piece when it came, none held back
    stop = text[len(text) // 2:][:3]
    cut = streamed(url, [c * 200, stop])
    assert "".join(cut) == text[: text.find(stop)]


def first_stop_cut(text: str, stops: list[str]) -> str:
    """The text up to the stop string that completes first (ending first; of those ending
    together, the longest): what a stream that stops at the first complete stop must give."""
    ends = [(i + len(s), -len(s)) for s in stops if (i := text.find(s)) >= 0]
    if not ends:
        return text
    end, neg = min(ends)
    return text[: end + neg]


def longest_stop_start(text: str, stops: list[str]) -> int:
    return max(k for k in range(len(text) + 1) if any(k < len(s) and s[:k] == text[len(text) - k:] for s in stops))


@given(text=st.text(alphabet="ab\n", max_size=40), stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=6),
       min_size=1, max_size=4), cuts=st.lists(st.integers(0, 40), max_size=12))
@settings(max_examples=600, deadline=None)
def test_stop_text_property(text, stops, cuts):
    """However the text arrives in pieces: the emitted text is the whole text cut at the first
    stop, and before a stop everything is emitted except the longest tail that could start one."""
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    cut, out = StopText(stops), ""
    for i, p in enumerate(pieces):
        out += cut.push(p)
        if not cut.stopped:
            sofar = "".join(pieces[: i + 1])
            assert out == sofar[: len(sofar) - longest_stop_start(sofar, stops)]
    out += cut.push("", final=True)
    assert out == first_stop_cut(text, stops)
