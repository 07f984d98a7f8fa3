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
from edgekv.serve.server import BackgroundServer  # noqa: E402


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
