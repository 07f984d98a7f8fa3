"""The HTTP layer (Starlette, served by uvicorn): OpenAI's chat and completions APIs, OpenAI's
Responses API and Anthropic's Messages API over one engine. Each chat-like API translates its
request into the same ChatAsk (serve/chat.py, messages.py, responses.py), rendered through the
chat template here and handed to the runtime's Batcher; its reply (serve/reply.py) is rendered
in that API's response format. No scheduling or KV state lives here: the batcher
(edgekv/runtime/batching/) owns all of it and runs every graph call on its own thread; tokens
cross to the asyncio handlers through an asyncio.Queue per request.

What a request costs the event loop is bounded: the body is read up to `max_body_bytes`, and the
JSON parse, the checks, the template render and the tokenizer run on a worker thread, so /health
and the running streams stay served while a large prompt is prepared."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgekv.errors import ContextOverflow, EdgeKVError, QueueFull
from edgekv.runtime.batching import Batcher, Request
from edgekv.runtime.reasoning import opens_reasoning, template_thinks
from edgekv.runtime.sampling import SamplingDefaults
from edgekv.runtime.text import TextCodec
from edgekv.serve import LOCAL_HOSTS, structured, tools
from edgekv.serve.api import Api, ApiAsk, ApiError, ChatAsk, ClientGone
from edgekv.serve.chat import ChatFormat, chat_request
from edgekv.serve.drain import CUT_CODE, LiveReplies, emitter
from edgekv.serve.fields import (COMPLETION_UNSUPPORTED, MAX_BODY_BYTES, encode_unlocked, flag, include_usage_of,
                                 max_token_chars, max_tokens_of, parse_json, prompt_of, refuse_unsupported,
                                 sampling_of, stops_of)
from edgekv.serve.front import Front, api_of_path, caller, check_version, read_body, tenant_of
from edgekv.serve.messages import MessagesFormat, messages_request
from edgekv.serve.metrics import Metrics
from edgekv.serve.reply import Reply
from edgekv.serve.responses import ResponsesFormat, responses_request
from edgekv.serve.tool_grammar import request_constraint
from edgekv.serve.tool_plan import tools_of

log = logging.getLogger("edgekv.serve")


STATES = ("loading", "ready", "draining")
RETRY_AFTER_S = 1  # a full queue drains in about one request's time
FORMATS = {Api.COMPLETIONS: ChatFormat, Api.CHAT: ChatFormat, Api.MESSAGES: MessagesFormat,
           Api.RESPONSES: ResponsesFormat}
# the fields of the chat API a translated request's errors name as its own API does
RENAMED = {Api.RESPONSES: {"response_format": "text", "max_tokens": "max_output_tokens"}}


class Server:
    """The app's state and handlers. `api_keys`: the keys a client may send (none: no check);
    `max_body_bytes`: the largest request body (413 beyond); `bind_host`: where the server listens
    (on a local bind the Host header must name this machine, against DNS rebinding)."""

    def __init__(self, batcher: Batcher, codec: TextCodec, model: str, api_keys: Sequence[str] | str | None = (),
                 metrics: Metrics | None = None, *, max_body_bytes: int = MAX_BODY_BYTES,
                 bind_host: str = "127.0.0.1", bundle=None, sampling_defaults: SamplingDefaults = SamplingDefaults()):
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys or ())
        if not all(isinstance(k, str) and k for k in keys):
            raise ValueError("API keys must be non-empty strings")
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be at least 1")
        self.batcher, self.codec, self.model = batcher, codec, model
        self.sampling_defaults = sampling_defaults  # what a request that sets no sampling gets
        self.keys = [(k.encode("utf-8"), tenant_of(k)) for k in keys]
        self.max_body_bytes = max_body_bytes
        self.check_host = bind_host.strip("[]") in LOCAL_HOSTS
        self.max_chars = batcher.limit * max_token_chars(codec)
        self.metrics = metrics or Metrics(batcher)
        self.created = int(time.time())
        self.state = "ready"
        self.live = LiveReplies()  # the replies being written: a drain that runs out cuts them (serve/drain.py)
        # the bundle drives tools, response_format and logprobs (None: they get a 400)
        self.bundle = bundle
        self.takes_tools = bundle is not None and tools.template_takes_tools(bundle.chat_template)
        # a thinking template (Qwen3, SmolLM3): replies' <think> parts go to reasoning_content
        self.thinks = bundle is not None and template_thinks(bundle.chat_template)

    def grammar_tokenizer(self):
        """The bundle's llguidance tokenizer, built on the first request that needs it."""
        from edgekv.runtime.grammar_engine import GrammarError
        from edgekv.runtime.grammar_tokenizer import tokenizer_for
        if self.bundle is None:
            raise ApiError(400, "this server was started without its bundle: tools, response_format and "
                                "logprobs are not available", code="unsupported_parameter")
        try:
            return tokenizer_for(self.bundle)
        except GrammarError as e:
            raise ApiError(400, str(e), code="unsupported_parameter") from None

    def stop_ids(self, constrained: bool) -> frozenset[int]:
        if not constrained:
            return frozenset(self.codec.stop_ids)
        from edgekv.runtime.grammar_tokenizer import stop_ids_of
        return frozenset(self.codec.stop_ids) | frozenset(stop_ids_of(self.bundle))

    def token_bytes(self, t: int) -> bytes:
        return self.grammar_tokenizer().ll.decode_bytes([t])

    def cut_error(self) -> ApiError:
        """What a reply cut by the drain ends with (the stream's last event, or a whole reply's 503)."""
        return ApiError(503, self.live.message or "the server is shutting down", kind="server_error", code=CUT_CODE)

    def set_state(self, state: str) -> None:
        """loading (before the warm-up), ready, draining (shutting down): /health says which, and
        answers 503 unless ready; new generation requests get 503 unless ready."""
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}, not {state!r}")
        self.state = state

    def app(self) -> Starlette:
        def post(path: str, api: Api, prepare: Callable[[bytes], ApiAsk]) -> Route:
            return Route(path, self.guard(lambda request: self.serve(request, prepare), api), methods=["POST"])

        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.guard(self.prom), methods=["GET"]),
            Route("/v1/models", self.guard(self.models), methods=["GET"]),
            post("/v1/chat/completions", Api.CHAT, self.chat_ask),
            post("/v1/completions", Api.COMPLETIONS, self.completion_ask),
            post("/v1/messages", Api.MESSAGES, self.messages_ask),
            post("/v1/responses", Api.RESPONSES, self.responses_ask),
            Route("/v1/messages/count_tokens", self.guard(self.count_tokens, Api.MESSAGES), methods=["POST"]),
        ], middleware=[Middleware(Front, server=self)],
            exception_handlers={404: self.not_found, 405: self.not_allowed})

    # -- plumbing
    def guard(self, handler, api: Api = Api.CHAT):
        """The API key check, and every error as `api`'s JSON error."""
        async def wrapped(request: HttpRequest):
            endpoint = request.url.path
            try:
                request.state.tenant = caller(request, self.keys)
                check_version(request, api)
                resp = await handler(request)
            except ApiError as e:
                resp = e.response(api)
            except (ClientGone, ClientDisconnect):
                self.metrics.disconnect()
                resp = Response(status_code=499)  # nginx's "client closed request": for the log and metrics
            except Exception:
                log.exception("edgekv serve: %s %s failed", request.method, endpoint)
                resp = ApiError(500, "internal error (see the server log)", kind="server_error").response(api)
            self.metrics.request(endpoint, resp.status_code)
            return resp
        return wrapped

    async def not_found(self, request, exc):
        return ApiError(404, f"no route {request.url.path[:200]}", code="not_found").response(
            api_of_path(request.url.path))

    async def not_allowed(self, request, exc):
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                        headers=getattr(exc, "headers", None)).response(api_of_path(request.url.path))

    def check_length(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, text that cannot fit the context however it tokenizes."""
        if chars > self.max_chars:
            raise ApiError(413, f"the {param} hold {chars} characters; the context holds {self.batcher.limit} tokens, "
                                f"at most {self.max_chars} characters of this tokenizer", param=param,
                           code="context_length_exceeded")

    # -- endpoints
    async def health(self, request: HttpRequest) -> Response:
        reason = self.batcher.fault()
        status = "ok" if self.state == "ready" and reason is None else ("error" if reason else self.state)
        body = {"status": status, "state": self.state, **({"reason": reason} if reason else {}), **self.batcher.stats()}
        later = {"Retry-After": str(RETRY_AFTER_S)} if status in ("loading", "draining") else None
        return JSONResponse(body, status_code=200 if status == "ok" else 503, headers=later)

    async def prom(self, request: HttpRequest) -> Response:
        body, ctype = self.metrics.render()
        return Response(body, media_type=ctype)

    async def models(self, request: HttpRequest) -> Response:
        d = self.sampling_defaults
        unset = {"temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k, "repeat_penalty": d.repeat_penalty,
                 "source": d.source}  # what a request that sets no sampling gets
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                                         "owned_by": "edgekv", "sampling_defaults": unset}]})

    async def count_tokens(self, request: HttpRequest) -> Response:
        """Anthropic's count_tokens: the prompt a Messages request would send, in tokens."""
        self.check_ready()
        raw = await read_body(request, self.max_body_bytes)

        def count() -> int:
            ask = messages_request(parse_json(raw), self.sampling_defaults, counting=True)
            plan = tools_of(ask.structured)
            return len(encode_unlocked(self.codec, self.render(ask, plan)))

        return JSONResponse({"input_tokens": await asyncio.to_thread(count)})

    # -- the requests (each prepared on a worker thread)
    def chat_ask(self, raw: bytes) -> ApiAsk:
        return self.ask(chat_request(parse_json(raw), self.sampling_defaults), Api.CHAT)

    def messages_ask(self, raw: bytes) -> ApiAsk:
        return self.ask(messages_request(parse_json(raw), self.sampling_defaults), Api.MESSAGES)

    def responses_ask(self, raw: bytes) -> ApiAsk:
        return self.ask(responses_request(parse_json(raw), self.sampling_defaults), Api.RESPONSES)

    def render(self, c: ChatAsk, plan) -> str:
        """The prompt text of a chat-like request: its messages through the chat template."""
        self.check_length(sum(len(m.get("content") or "") for m in c.messages), c.param)
        codec = self.codec.with_thinking(c.thinking) if c.thinking is not None else self.codec
        try:
            return tools.render_prompt(codec, c.messages, plan, self.takes_tools)
        except EdgeKVError as e:
            raise ApiError(400, str(e), param=c.param) from None

    def ask(self, c: ChatAsk, api: Api) -> ApiAsk:
        """Any chat-like API's request, translated: its grammar, its prompt, its tokens."""
        if c.logprobs is not None:
            self.grammar_tokenizer()  # its bytes of each token
        asked = any(c.structured.get(f) not in (None, False, [], "none", {"type": "text"}) for f in
                    ("tools", "tool_choice", "response_format"))
        try:
            constraint, plan = (request_constraint(c.structured, self.grammar_tokenizer(), c.max_tokens)
                                if asked else (None, tools_of(c.structured)))
        except ApiError as e:  # a 400 names the chat field; this API may call it otherwise
            e.param = RENAMED.get(api, {}).get(e.param, e.param)
            raise
        if c.prefill and constraint is not None:
            raise ApiError(400, "a final assistant turn (a prefill) cannot be continued under tools or a JSON "
                                "format: the grammar starts the reply itself", param=c.param)
        text = self.render(c, plan) + c.prefill  # a prefill: the reply goes on from it
        # a reply held to a response_format starts with its JSON, whatever the prompt left open
        shaped = constraint is not None and plan is None
        return ApiAsk(encode_unlocked(self.codec, text), c.max_tokens, c.params, c.stops, c.stream, api,
                      constraint=constraint, plan=plan, logprobs=c.logprobs, include_usage=c.include_usage,
                      split_reasoning=self.thinks, in_reasoning=self.thinks and not shaped and opens_reasoning(text),
                      param=c.param, echo=c.echo)

    def completion_ask(self, raw: bytes) -> ApiAsk:
        body = parse_json(raw)
        refuse_unsupported(body, COMPLETION_UNSUPPORTED)
        prompt = prompt_of(body)
        top = structured.logprobs_asked(body, chat=False)
        if top is not None:
            self.grammar_tokenizer()  # its bytes of each token
        opts = max_tokens_of(body), sampling_of(body, self.sampling_defaults), stops_of(body), flag(body, "stream")
        self.check_length(len(prompt), "prompt")
        return ApiAsk(encode_unlocked(self.codec, prompt), *opts, Api.COMPLETIONS, logprobs=top,
                      include_usage=include_usage_of(body), param="prompt")

    def check_ready(self) -> None:
        if self.state != "ready":
            elsewhere = " (or on another server)" if self.state == "draining" else ""
            raise ApiError(503, f"the server is {self.state}; retry later{elsewhere}", kind="server_error",
                           code=f"server_{self.state}", headers={"Retry-After": str(RETRY_AFTER_S)})

    async def serve(self, request: HttpRequest, prepare: Callable[[bytes], ApiAsk]) -> Response:
        self.check_ready()
        raw = await read_body(request, self.max_body_bytes)
        ask = await asyncio.to_thread(prepare, raw)
        if self.live.message is not None:  # the drain ran out while this request was prepared
            raise self.cut_error()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        req = Request(ask.prompt, ask.max_tokens, ask.params, stop_ids=self.stop_ids(ask.constraint is not None),
                      emit=emitter(loop, queue),
                      tenant=request.state.tenant, constraint=ask.constraint, logprobs=ask.logprobs)
        try:
            self.batcher.submit(req)
        except ContextOverflow as e:
            raise ApiError(413, f"{e}", code="context_length_exceeded", param=ask.param) from None
        except QueueFull as e:
            raise ApiError(429, f"{e}; retry later", kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EdgeKVError as e:
            raise ApiError(400, str(e)) from None
        reply = Reply(self, req, queue, ask, request.scope)
        self.live.add(reply, loop, queue)
        fmt = FORMATS[ask.api](reply)
        if ask.stream:
            return StreamingResponse(fmt.sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(fmt.whole(await reply.outcome(request)))
