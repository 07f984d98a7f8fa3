"""bench-serve's client against a stand-in server: streams that break off (a server that drops a
connection, as llama_cpp.server does to a running request when another arrives) are counted as
failed, not a traceback; the rates come from the streams that completed."""
import asyncio
import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from starlette.applications import Starlette  # noqa: E402
from starlette.responses import StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from edgekv.errors import EdgeKVError  # noqa: E402
from edgekv.serve.bench import level  # noqa: E402
from edgekv.serve.listen import BackgroundServer  # noqa: E402


def app(break_when):
    async def chat(request):
        body = await request.json()
        n, seed = body["max_tokens"], body["seed"]

        async def events():
            for i in range(n):
                if i == 1 and break_when(seed):
                    raise RuntimeError("dropped")  # the response ends without its last chunk
                yield "data: " + json.dumps({"choices": [{"delta": {"content": f"t{i} "}}]}) + "\n\n"
                await asyncio.sleep(0.001)
            yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def test_broken_streams_are_counted_not_raised(capsys):
    srv = BackgroundServer(app(lambda seed: seed % 2 == 1))
    try:
        r = asyncio.run(level(srv.url, 4, 5))
    finally:
        srv.close()
    assert r["failed"] == 2 and r["tokens"] == 2 * 5  # seeds 0 and 2 completed, 1 and 3 broke off
    assert "2 of 4 streams broke off" in capsys.readouterr().err


def test_every_stream_broken_is_one_error():
    srv = BackgroundServer(app(lambda seed: True))
    try:
        with pytest.raises(EdgeKVError, match="every stream broke off"):
            asyncio.run(level(srv.url, 2, 5))
    finally:
        srv.close()


def test_bench_serve_end_to_end_writes_json_into_a_new_folder(tiny_bundle_int8, tmp_path):
    """The whole command on a tiny bundle: every level, the shared prefix and the soak reported,
    the JSON written into a folder that did not exist."""
    from tests.conftest import run_edgekv

    out = tmp_path / "new" / "dir" / "serve.json"
    r = run_edgekv("bench-serve", tiny_bundle_int8, "--clients", "1,3", "--tokens", "4", "--system-tokens", "24",
                   "--soak", "6", "--json", out, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [lv["clients"] for lv in res["levels"]] == [1, 3]
    assert all(lv["failed"] == 0 and 0 < lv["tokens"] <= 4 * lv["clients"] for lv in res["levels"])
    assert res["levels"][0]["vs_one_client"] == 1.0
    assert res["levels"][1]["peak_kv_cells"] > 0
    assert res["soak"] == {**res["soak"], "requests": 6, "failed": 0}
    assert res["shared_prefix"]["first_ttft_ms"] > 0 and res["shared_prefix"]["second_ttft_ms"] > 0


def test_bench_serve_json_schema_compares_constrained_and_free_requests(tiny_bundle_int8, tmp_path):
    """--json-schema: per level the same requests with response_format and free, each round; the
    constrained ones' masks counted (the in-process server's constraints), the free ones' none."""
    pytest.importorskip("llguidance")
    from tests.conftest import run_edgekv

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"story": {"type": "string"}},
                                  "required": ["story"]}))
    out = tmp_path / "s.out.json"
    r = run_edgekv("bench-serve", tiny_bundle_int8, "--clients", "1,2", "--tokens", "6", "--json-schema", schema,
                   "--rounds", "2", "--threads", "1", "--json", out, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [lv["clients"] for lv in res["structured"]] == [1, 2] and res["levels"] == []
    for lv in res["structured"]:
        assert lv["failed"] == 0 and lv["mask_us_per_token"] > 0
        assert set(lv["per_client_tps"]) == {"json_schema", "free"} and lv["per_client_tps"]["json_schema"] > 0
    r = run_edgekv("bench-serve", tiny_bundle_int8, "--json-schema", tmp_path / "none.json", timeout=120)
    assert r.returncode == 1 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_each_api_streams_the_same_tokens_through_one_engine(rt_int8):
    """bench-serve's client through the chat, Messages and Responses APIs: the same requests (the
    same seeds) give the same token counts, and the counts are the servers' usage, not chunks;
    with several --api the command reports each API per level."""
    from tests.serving import serving

    with serving(rt_int8) as s:
        runs = {a: asyncio.run(level(s.url, 2, 12, api=a)) for a in ("chat", "messages", "responses")}
    assert all(r["failed"] == 0 for r in runs.values())
    assert runs["chat"]["tokens"] == runs["messages"]["tokens"] == runs["responses"]["tokens"] > 2


def test_bench_serve_compares_the_apis(tiny_bundle_int8, tmp_path):
    from tests.conftest import run_edgekv

    out = tmp_path / "apis.json"
    r = run_edgekv("bench-serve", tiny_bundle_int8, "--clients", "1,2", "--tokens", "6", "--rounds", "2",
                   "--api", "chat,messages,responses", "--threads", "1", "--ctx", "256", "--json", out)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert [lv["clients"] for lv in res["apis"]] == [1, 2]
    for lv in res["apis"]:
        assert set(lv["per_client_tps"]) == {"chat", "messages", "responses"} and lv["failed"] == 0
        assert len(set(lv["tokens"].values())) == 1  # the same requests through each API
