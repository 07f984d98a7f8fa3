"""The OpenAI-compatible HTTP layer (Starlette, served by uvicorn): parses requests, renders the
chat template, hands prompts to the runtime's Engine and streams its tokens back. No scheduling
or KV state lives here: the engine (edgekv/runtime/engine.py) owns all of it and runs every graph
call on its own thread; tokens cross to the asyncio handlers through an asyncio.Queue per request."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgekv.errors import ContextOverflow, EdgeKVError, QueueFull
from edgekv.runtime.engine import Engine, Request
from edgekv.runtime.sampling import SamplingParams
from edgekv.runtime.text import StreamDecoder, TextCodec
from edgekv.serve.metrics import Metrics

MAX_STOP = 4  # stop sequences per request, as OpenAI's API
ROLES = {"system", "user", "assistant"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# -- request fields
def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"'{name}' must be {kind} in [{lo}, {hi}] (got {v!r})", param=name)
    return v


def sampling_of(body: dict) -> SamplingParams:
    return SamplingParams(temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
                          top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0)),
                          top_k=int(_number(body, "top_k", 0, 0, 1 << 20, integer=True)),
                          repeat_penalty=float(_number(body, "repeat_penalty", 1.0, 0.1, 10.0)),
                          seed=_number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True))


def stops_of(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"'stop' must be a string or a list of up to {MAX_STOP} non-empty strings", param="stop")
    return stops


def text_of(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")


def messages_of(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a role of {sorted(ROLES)}", param="messages")
        out.append({"role": m["role"], "content": text_of(m.get("content"), i)})
    return out


class StopWatch:
    """Turns the token stream into text, cut at the first stop sequence; holds back only as much
    text as could still become the start of a stop sequence."""

    def __init__(self, codec: TextCodec, stops: list[str]):
        self.dec = StreamDecoder(codec)
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, token: int) -> str:
        return self._cut(self.dec.push(token), final=False)

    def flush(self) -> str:
        return self._cut(self.dec.flush(), final=True)

    def _cut(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        keep = 0 if final else min(self.hold, len(self.pending))
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out


class Server:
    def __init__(self, engine: Engine, codec: TextCodec, model: str, api_key: str | None = None,
                 metrics: Metrics | None = None):
        self.engine, self.codec, self.model, self.api_key = engine, codec, model, api_key
        self.metrics = metrics or Metrics(engine)
        self.created = int(time.time())

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.guard(self.prom), methods=["GET"]),
            Route("/v1/models", self.guard(self.models), methods=["GET"]),
            Route("/v1/chat/completions", self.guard(self.chat), methods=["POST"]),
            Route("/v1/completions", self.guard(self.completions), methods=["POST"]),
        ], exception_handlers={404: self.not_found, 405: self.not_allowed})

    # -- plumbing
    def guard(self, handler):
        """The API key check, and every ApiError as OpenAI's JSON error."""
        async def wrapped(request: HttpRequest):
            endpoint = request.url.path
            try:
                if self.api_key is not None:
                    auth = request.headers.get("authorization", "")
                    if auth != f"Bearer {self.api_key}":
                        raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                       kind="authentication_error", code="invalid_api_key")
                resp = await handler(request)
            except ApiError as e:
                resp = e.response()
            self.metrics.request(endpoint, resp.status_code)
            return resp
        return wrapped

    async def not_found(self, request, exc):
        return ApiError(404, f"no route {request.url.path}", code="not_found").response()

    async def not_allowed(self, request, exc):
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}").response()

    async def body_of(self, request: HttpRequest) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    # -- endpoints
    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", **self.engine.stats()})

    async def prom(self, request: HttpRequest) -> Response:
        body, ctype = self.metrics.render()
        return Response(body, media_type=ctype)

    async def models(self, request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                                         "owned_by": "edgekv"}]})

    async def chat(self, request: HttpRequest) -> Response:
        body = await self.body_of(request)
        msgs = messages_of(body)
        try:
            prompt = self.codec.chat_ids(msgs)
        except EdgeKVError as e:
            raise ApiError(400, str(e), param="messages") from None
        return await self.generate(body, prompt, chat=True)

    async def completions(self, request: HttpRequest) -> Response:
        body = await self.body_of(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
        return await self.generate(body, self.codec.encode(prompt), chat=False)

    async def generate(self, body: dict, prompt: list[int], chat: bool) -> Response:
        max_tokens = _number(body, "max_completion_tokens", None, 1, 1 << 20, integer=True)
        max_tokens = _number(body, "max_tokens", max_tokens or 256, 1, 1 << 20, integer=True)
        params, stops = sampling_of(body), stops_of(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be true or false", param="stream")
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n = 1 is supported", param="n")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        req = Request(prompt, max_tokens, params, stop_ids=self.codec.stop_ids,
                      emit=lambda kind, value: loop.call_soon_threadsafe(queue.put_nowait, (kind, value)))
        try:
            self.engine.submit(req)
        except ContextOverflow as e:
            raise ApiError(413, f"{e}", code="context_length_exceeded", param="messages" if chat else "prompt") from None
        except QueueFull as e:
            raise ApiError(429, f"{e}; retry later", kind="rate_limit_error", code="queue_full") from None
        except EdgeKVError as e:
            raise ApiError(400, str(e)) from None
        reply = Reply(self, req, queue, StopWatch(self.codec, stops), chat, body.get("model") or self.model)
        if stream:
            return StreamingResponse(reply.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await reply.whole()


class Reply:
    """One request's answer, whole or as server-sent events; the engine's request is cancelled
    whenever the answer ends early (a stop sequence, a client gone)."""

    def __init__(self, server: Server, req: Request, queue: asyncio.Queue, watch: StopWatch, chat: bool, model: str):
        self.server, self.req, self.queue, self.watch, self.chat, self.model = server, req, queue, watch, chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.completion_tokens = 0

    async def events(self):
        """(text, finish_reason) pieces; finish_reason is set on the last."""
        try:
            while True:
                kind, value = await self.queue.get()
                if kind == "token":
                    if self.completion_tokens == 0:
                        self.server.metrics.first_token(self.req)
                    self.completion_tokens += 1
                    text = self.watch.push(value)
                    if self.watch.stopped:
                        self.server.engine.cancel(self.req)
                        yield text, "stop"
                        return
                    if text:
                        yield text, None
                else:
                    if value == "error":
                        raise ApiError(500, "the engine failed while generating (see the server log)",
                                       kind="server_error")
                    yield self.watch.flush(), "length" if value == "length" else "stop"
                    return
        finally:
            if self.req.finish_reason is None:
                self.server.engine.cancel(self.req)  # a client gone, or an early end: free its cells now

    def usage(self) -> dict:
        p = len(self.req.prompt)
        return {"prompt_tokens": p, "completion_tokens": self.completion_tokens,
                "total_tokens": p + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.req.reused}}

    async def whole(self) -> Response:
        parts, finish = [], "stop"
        async for text, fin in self.events():
            parts.append(text)
            finish = fin or finish
        text = "".join(parts)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()})

    def chunk(self, text: str | None, finish: str | None, role: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        if finish:
            out["usage"] = self.usage()
        return f"data: {json.dumps(out)}\n\n"

    async def sse(self):
        if self.chat:
            yield self.chunk(None, None, role=True)
        try:
            async for text, fin in self.events():
                if text and fin:
                    yield self.chunk(text, None)
                    yield self.chunk(None, fin)
                else:
                    yield self.chunk(text, fin)
        except ApiError as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind}})}\n\n"
        yield "data: [DONE]\n\n"
