"""`edgekv serve` over HTTP on the tiny int8 bundle: the official openai client (streaming and
not) gets what the runtime decodes alone; concurrent clients, prefix reuse through the API, a
dropped stream frees its cells, every error status, the queue's 429, a soak."""
import asyncio
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

# the serve extra and the test clients; without them these tests are skipped, visibly
for _m in ("starlette", "uvicorn", "prometheus_client"):
    pytest.importorskip(_m)
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from tests.conftest import ROOT, run_edgekv  # noqa: E402
from tests.serving import built  # noqa: E402
from tests.stream_reference import reference


@pytest.fixture(scope="module")
def rt(rt_int8):
    return rt_int8  # conftest's tiny int8 runtime


@pytest.fixture(scope="module")
def served(tiny_bundle_int8):
    """The server on a runtime of its own (rt's twin: the same bundle, cells and threads): the
    oracle's alone runs on `rt` never share a backend with a step the server may still be taking
    (a reply cut by a stop string returns before its engine's last step is done)."""
    from edgekv.runtime.assemble import open_runtime

    with open_runtime(tiny_bundle_int8, ctx=256, backend="ort-cpu", threads=1) as own, \
            built(own, ctx=256, parallel=4, max_queue=64, prefill_chunk=32) as s:
        yield s.batcher, s.url


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def alone_text(rt, messages, n):
    """Greedy reply decoded by the runtime alone (Generator), up to a stop token or n tokens."""
    codec = rt.codec
    g = reference(rt, capacity=256)
    logits = g.prefill(codec.chat_ids(messages))
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        if t in codec.stop_ids:
            break
        out.append(t)
        logits = g.decode_step(t)
    return codec.decode(out), len(out)


MSGS = [{"role": "system", "content": "The capital of France is Paris."},
        {"role": "user", "content": "Tell me about robots and trains."}]


def test_openai_client_whole_and_streamed_equal_the_runtime_alone(rt, served):
    _, url = served
    want, n = alone_text(rt, MSGS, 24)
    c = client(url)
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want
    assert r.usage.completion_tokens == n and r.usage.prompt_tokens == len(rt.codec.chat_ids(MSGS))
    assert r.choices[0].finish_reason == ("length" if n == 24 else "stop")
    chunks = list(c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    # include_usage, as OpenAI sends it: one last chunk without choices holds the usage, no other chunk does
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert all(ch.usage is None for ch in chunks[:-1])
    # the second request's system prompt came from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    # completions: the raw prompt, no template
    prompt = "The capital of France"
    g = reference(rt, capacity=64)
    first = int(np.argmax(g.prefill(rt.codec.encode(prompt))))
    rc = c.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0)
    assert rc.usage.completion_tokens == 1 and rc.choices[0].text == rt.codec.decode([first])
    assert [m.id for m in c.models.list().data] == [rt.bundle.manifest["name"]]


def test_stop_sequence_cuts_the_text(rt, served):
    _, url = served
    want, _ = alone_text(rt, MSGS, 24)
    stop = want[5:8]
    assert stop and stop not in want[:5] + want[5:7]
    r = client(url).chat.completions.create(model="t", messages=MSGS, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].message.content == want[: want.find(stop)] and r.choices[0].finish_reason == "stop"


def test_concurrent_clients_each_get_their_lone_answer(rt, served):
    engine, url = served
    convs = [[{"role": "user", "content": f"Tell me about tea number {i}."}] for i in range(6)]
    want = [alone_text(rt, m, 16)[0] for m in convs]
    steps0, gen0 = engine.counters["steps"], engine.counters["generated_tokens"]

    async def main():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

        async def one(m):
            s = await c.chat.completions.create(model="t", messages=m, max_tokens=16, temperature=0, stream=True)
            return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
        return await asyncio.gather(*(one(m) for m in convs))

    got = asyncio.run(main())
    assert got == want
    # decoded together: fewer steps than tokens
    assert engine.counters["steps"] - steps0 < engine.counters["generated_tokens"] - gen0


def test_dropped_stream_frees_its_cells(served):
    engine, url = served
    body = {"model": "t", "messages": MSGS, "max_tokens": 200, "temperature": 0.0, "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(8):
                next(lines)
            assert engine.stats()["active"] == 1
    # closed mid-stream: the engine cancels it and frees its cells (all but the prefix cache's)
    deadline = time.time() + 10
    while time.time() < deadline and (engine.stats()["active"] or engine.pool.used() != engine.pool.cached_only()):
        time.sleep(0.02)
    assert engine.stats()["active"] == 0 and engine.pool.used() == engine.pool.cached_only()


def test_error_statuses(served, rt):
    engine, url = served
    post = lambda body, **kw: httpx.post(url + "/v1/chat/completions", timeout=30, **({"json": body} | kw))  # noqa: E731
    bad = [
        dict(content=b"{not json", headers={"content-type": "application/json"}),
        dict(content=b"[1, 2]", headers={"content-type": "application/json"}),
    ]
    for kw in bad:
        r = httpx.post(url + "/v1/chat/completions", timeout=30, **kw)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    for body in [{}, {"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                 {"messages": MSGS, "max_tokens": 0}, {"messages": MSGS, "temperature": "hot"},
                 {"messages": MSGS, "top_p": 2}, {"messages": MSGS, "stop": [1]}, {"messages": MSGS, "stream": "yes"},
                 {"messages": [{"role": "user", "content": 5}]}]:
        r = post(body)
        assert r.status_code == 400, body
        assert r.json()["error"]["message"]
    long = [{"role": "user", "content": "robots trains tea " * 200}]
    assert len(rt.codec.chat_ids(long)) > 256
    r = post({"messages": long})
    assert r.status_code == 413 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url + "/v1/completions", json={"prompt": ""}, timeout=30)
    assert r.status_code == 400
    assert httpx.get(url + "/v1/nothing", timeout=30).status_code == 404
    # the server still answers
    assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"


def test_api_key(rt):
    with built(rt, ctx=64, parallel=1, max_queue=4, api_key="sekrit") as srv:
        for key in ("wrong", None):
            h = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.get(srv.url + "/v1/models", headers=h, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            client(srv.url, "wrong").models.list()
        assert client(srv.url, "sekrit").models.list().data
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200


def test_queue_full_is_429(rt):
    body = {"model": "t", "messages": MSGS, "max_tokens": 4, "temperature": 0.0}
    with built(rt, ctx=256, parallel=1, max_queue=1) as (_, engine, url):
        engine.pause()  # nothing is admitted: the first request takes the free slot, the second the queue
        waiting = {}
        threads = [threading.Thread(target=lambda i=i: waiting.setdefault(i, httpx.post(
            url + "/v1/chat/completions", json=body, timeout=60))) for i in range(2)]
        for i, t in enumerate(threads):
            t.start()
            while engine.stats()["waiting"] < i + 1:
                time.sleep(0.01)
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
        with pytest.raises(openai.RateLimitError):
            client(url).chat.completions.create(model="t", messages=MSGS, max_tokens=2)
        engine.pause(False)
        for t in threads:
            t.join(60)
        assert [waiting[i].status_code for i in range(2)] == [200, 200]  # the waiting ones ran


def test_metrics_and_soak(served):
    """Hundreds of requests, good and malformed, some dropped mid-stream: the server stays up,
    every cell comes back, and the metrics count them."""
    engine, url = served

    async def main():
        async with httpx.AsyncClient(timeout=60) as h:
            async def good(i):
                r = await h.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "system", "content": "The capital of France is Paris."},
                                 {"role": "user", "content": f"tea {i % 7}"}], "max_tokens": 1 + i % 4,
                    "temperature": 0.7, "seed": i})
                return r.status_code

            async def bad(i):
                r = await h.post(url + "/v1/chat/completions", content=b"{" * (i % 3 + 1),
                                 headers={"content-type": "application/json"})
                return r.status_code

            async def dropped(i):
                async with h.stream("POST", url + "/v1/completions", json={
                        "prompt": "robots", "max_tokens": 50, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        break
                return r.status_code

            codes = []
            for start in range(0, 300, 30):
                kinds = [(good, bad, dropped)[i % 3](i) for i in range(start, start + 30)]
                codes += await asyncio.gather(*kinds)
            return codes

    codes = asyncio.run(main())
    assert codes.count(400) == 100 and codes.count(200) == 200
    deadline = time.time() + 20
    while time.time() < deadline and engine.pool.used() != engine.pool.cached_only():
        time.sleep(0.05)
    assert engine.stats()["active"] == 0 and engine.pool.used() == engine.pool.cached_only()
    text = httpx.get(url + "/metrics", timeout=30).text
    assert 'edgekv_requests_total{endpoint="/v1/chat/completions",status="400"}' in text
    assert "edgekv_ttft_seconds_bucket" in text and "edgekv_cells_free" in text
    ok = [line for line in text.splitlines() if line.startswith("edgekv_requests_total") and 'status="200"' in line]
    assert sum(float(line.split()[-1]) for line in ok) >= 200


def test_cli_prints_the_url_and_warns_beyond_localhost(tiny_bundle_int8):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "edgekv", "serve", str(tiny_bundle_int8), "--host", "0.0.0.0",
                          "--port", "0", "--ctx", "64", "--backend", "ort-cpu", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = p.stdout.readline()
        assert line.startswith("edgekv serve: http://0.0.0.0:") and ":0/v1" not in line  # the port it got
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert "without --api-key" in err
    r = run_edgekv("serve", "/nonexistent/bundle")
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
