"""bench-serve measures serve as it runs: its --slots layout (fused slots on a static int8
bundle), and a stream that ends in an SSE error event counts as a failed request, not a success."""
import asyncio
import json

import pytest


def test_bench_serve_runs_serves_fused_slots_on_a_static_bundle(tiny_bundle_int8_static, tmp_path):
    from tests.conftest import run_edgekv

    out = tmp_path / "serve.json"
    r = run_edgekv("bench-serve", tiny_bundle_int8_static, "--clients", "1,2", "--tokens", "4", "--system-tokens", "24",
                   "--soak", "2", "--ctx", "256", "--threads", "1", "--json", out, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert "2 fused slots of 128 cells" in res["server"] and "fused slots" in r.stderr
    assert all(lv["failed"] == 0 and lv["tokens"] > 0 for lv in res["levels"])
    assert res["shared_prefix"]["second_ttft_ms"] > 0
    r = run_edgekv("bench-serve", tiny_bundle_int8_static, "--clients", "1", "--tokens", "2", "--system-tokens", "200",
                   "--soak", "0", "--ctx", "256", "--slots", "2", "--threads", "1", timeout=600)
    assert r.returncode == 0 and "left out (a slot holds 128 cells" in r.stderr, r.stderr[-2000:]
    r = run_edgekv("bench-serve", tiny_bundle_int8_static, "--clients", "1", "--tokens", "2", "--soak", "0", "--system-tokens", "24",
                   "--ctx", "256", "--slots", "0", "--threads", "1", "--json", out, timeout=600)
    server = json.loads(out.read_text())["server"]
    assert r.returncode == 0 and "256 cells" in server and "fused slots" not in server, r.stderr[-2000:]


def test_a_stream_ending_in_an_sse_error_is_a_failed_request():
    httpx = pytest.importorskip("httpx")
    from edgekv.serve.bench import stream_one

    chunk = {"choices": [{"delta": {"content": "a"}}]}
    body = (f"data: {json.dumps(chunk)}\n\n"
            f"data: {json.dumps({'error': {'message': 'the model produced NaN', 'type': 'server_error'}})}\n\n"
            "data: [DONE]\n\n")

    def reply(request):
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def one():
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as h:
            return await stream_one(h, "http://x", [{"role": "user", "content": "hi"}], 4, 0)

    r = asyncio.run(one())
    assert "error" in r and "NaN" in r["error"] and r["tokens"] == 1
