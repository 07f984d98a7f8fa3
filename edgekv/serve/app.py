"""The OpenAI-compatible HTTP layer (Starlette, served by uvicorn): parses requests, renders the
chat template, hands prompts to the runtime's Batcher and streams its tokens back. No scheduling
or KV state lives here: the batcher (edgekv/runtime/batching/) owns all of it and runs every graph
call on its own thread; tokens cross to the asyncio handlers through an asyncio.Queue per request.

What a request costs the event loop is bounded: the body is read up to `max_body_bytes`, and the
JSON parse, the checks, the template render and the tokenizer run on a worker thread, so /health
and the running streams stay served while a large prompt is prepared."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgekv.errors import ContextOverflow, EdgeKVError, QueueFull
from edgekv.runtime.batching import Batcher, Done, Request, Token
from edgekv.runtime.reasoning import ReasoningSplitter, opens_reasoning, split_reply, template_thinks
from edgekv.runtime.sampling import SamplingDefaults, SamplingParams
from edgekv.runtime.text import StreamDecoder, TextCodec
from edgekv.serve import LOCAL_HOSTS
from edgekv.serve import structured, tools
from edgekv.serve.drain import CUT, CUT_CODE, LiveReplies, emitter
from edgekv.serve.metrics import Metrics

log = logging.getLogger("edgekv.serve")

MAX_STOP = 4  # stop sequences per request, as OpenAI's API
# nginx's default client_max_body_size: a 32k-token context of text fits even as \u-escaped JSON,
# and a hostile body of nested empty lists (the worst case, ~20x its size once parsed) stays ~20 MB
MAX_BODY_BYTES = 1 << 20
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}  # as given -> as rendered
LOCAL_NAMES = {"127.0.0.1", "localhost", "[::1]"}  # what a Host header may name for such a bind (any port)
STATES = ("loading", "ready", "draining")
RETRY_AFTER_S = 1  # a full queue drains in about one request's time


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.headers = status, kind, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": str(self), "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client hung up before its whole answer was ready."""


# -- request fields
def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; every way json.loads can fail is a 400 (ValueError covers bad
    UTF-8 and integers past Python's digit limit, RecursionError deep nesting)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type or not lo <= v <= hi:
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"'{name}' must be {kind} in [{lo}, {hi}] (got {str(v)[:40]})", param=name)
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be true, false or null", param=name)
    return bool(v)


def _text(s, param: str) -> str:
    """A string the tokenizer can take: a lone surrogate ("\\udcff" in JSON) is not UTF-8."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{param}' holds a lone surrogate (not valid Unicode text)", param=param) from None
    return s


def seed_of(body: dict) -> int | None:
    """Any 64-bit seed, as OpenAI takes; a negative one is read as its unsigned 64-bit pattern
    (distinct seeds stay distinct; numpy's generator takes only non-negative seeds)."""
    seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
    return None if seed is None else seed & ((1 << 64) - 1)


def sampling_of(body: dict, unset: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """A request's sampling; what it leaves unset comes from the server's defaults (the model's)."""
    return SamplingParams(temperature=float(_number(body, "temperature", unset.temperature, 0.0, 2.0)),
                          top_p=float(_number(body, "top_p", unset.top_p, 0.0, 1.0)),
                          top_k=int(_number(body, "top_k", unset.top_k, 0, 1 << 20, integer=True)),
                          repeat_penalty=float(_number(body, "repeat_penalty", unset.repeat_penalty, 0.1, 10.0)),
                          seed=seed_of(body))


def stops_of(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"'stop' must be a string or a list of up to {MAX_STOP} non-empty strings", param="stop")
    return [_text(s, "stop") for s in stops]


def max_tokens_of(body: dict) -> int:
    cap = _number(body, "max_completion_tokens", None, 1, 1 << 20, integer=True)
    return _number(body, "max_tokens", cap or 256, 1, 1 << 20, integer=True)


def text_of(content, i: int) -> str:
    if isinstance(content, str):
        return _text(content, "messages")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return _text("".join(p["text"] for p in content), "messages")
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")


def messages_of(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a role of {sorted(ROLES)}", param="messages")
        out.append({"role": ROLES[m["role"]], "content": text_of(m.get("content"), i)})
    return out


def prompt_of(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    return _text(prompt, "prompt")


# -- fields that would change the answer but are not implemented: refused until they are, so a
# client that asks for JSON or a tool call is told instead of getting prose. field -> (is the
# value harmless, what is accepted)
def _absent_or(*ok) -> Callable[[object], bool]:
    return lambda v: v is None or any(v == o and type(v) is type(o) for o in ok)


COMMON_UNSUPPORTED = {
    "n": (_absent_or(1), "1 or null: one sequence per request"),
    "logit_bias": (_absent_or({}), "{} or null"),
    "presence_penalty": (_absent_or(0, 0.0), "0 or null"),
    "frequency_penalty": (_absent_or(0, 0.0), "0 or null"),
}
CHAT_UNSUPPORTED = COMMON_UNSUPPORTED | {  # tools, response_format, logprobs: edgekv/serve/tools.py, structured.py
    "functions": (_absent_or([]), "[] or null (use 'tools')"),
    "function_call": (_absent_or("none"), '"none" or null (use \'tool_choice\')'),
}
COMPLETION_UNSUPPORTED = COMMON_UNSUPPORTED | {
    "echo": (_absent_or(False), "false or null"),
    "suffix": (_absent_or(""), '"" or null'),
    "best_of": (_absent_or(1), "1 or null"),
}
# fields that need the grammar tokenizer (llguidance): plain requests never build it
STRUCTURED_FIELDS = ("tools", "tool_choice", "response_format", "logprobs", "top_logprobs")


def refuse_unsupported(body: dict, table: dict) -> None:
    for name, (harmless, accepted) in table.items():
        if not harmless(body.get(name)):
            raise ApiError(400, f"'{name}' is not supported yet (only {accepted})", param=name,
                           code="unsupported_parameter")


# -- stop sequences
def _held_back(pending: str, stops: list[str]) -> int:
    """Length of the longest suffix of `pending` that is a proper prefix of some stop string:
    the only text that could still turn out to be part of a stop."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(pending)), best, -1):
            if s.startswith(pending[len(pending) - k:]):
                best = k
                break
    return best


class StopText:
    """Text pieces in, text out cut before the first stop string to complete (the one ending
    first; of those ending together, the longest), whatever the pieces; holds back only text that
    could still be the start of a stop string and emits the rest at once."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""
        self.stopped = False

    def push(self, text: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        self.pending += text
        found = [(i + len(s), i) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            self.stopped = True
            out, self.pending = self.pending[: min(found)[1]], ""
            return out
        keep = 0 if final else _held_back(self.pending, self.stops)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out


class StopWatch:
    """Turns the token stream into text (never half a character), cut at the first stop."""

    def __init__(self, codec: TextCodec, stops: list[str]):
        self.dec = StreamDecoder(codec)
        self.cut = StopText(stops)

    @property
    def stopped(self) -> bool:
        return self.cut.stopped

    def push(self, token: int) -> str:
        return self.cut.push(self.dec.push(token))

    def flush(self) -> str:
        return self.cut.push(self.dec.flush(), final=True)


@dataclass
class ApiAsk:
    """A checked request, ready to submit."""
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    stops: list[str]
    stream: bool
    chat: bool
    constraint: object = None  # a GrammarConstraint (response_format or tools), None: free
    plan: "tools.ToolPlan | None" = None  # the request's tools
    logprobs: int | None = None  # alternatives per token (None: no logprobs)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    split_reasoning: bool = False  # the template thinks: the reply's <think> part is reasoning_content
    in_reasoning: bool = False  # the prompt leaves a <think> open: the reply starts in its reasoning


# chat_template_kwargs a client may send (vLLM's field): name -> the type its value must have
TEMPLATE_KWARGS = {"enable_thinking": bool}


def template_kwargs_of(body: dict) -> dict:
    """chat_template_kwargs, as vLLM takes it: an object of the keys above (others are a 400
    naming them: a template variable the server does not know is never passed on)."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise ApiError(400, "'chat_template_kwargs' must be an object or null", param="chat_template_kwargs")
    unknown = sorted(k for k in kw if k not in TEMPLATE_KWARGS)
    if unknown:
        raise ApiError(400, f"'chat_template_kwargs' takes only {', '.join(TEMPLATE_KWARGS)}; not "
                            f"{', '.join(repr(k[:40]) for k in unknown[:8])}", param="chat_template_kwargs",
                       code="unsupported_parameter")
    for k, v in kw.items():
        if v is not None and type(v) is not TEMPLATE_KWARGS[k]:
            raise ApiError(400, f"chat_template_kwargs.{k} must be true, false or null", param="chat_template_kwargs")
    return {k: v for k, v in kw.items() if v is not None}


def include_usage_of(body: dict) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise ApiError(400, "'stream_options' must be an object or null", param="stream_options")
    return _flag(so, "include_usage")


def encode_unlocked(codec: TextCodec, text: str) -> list[int]:
    """codec.encode(text), through the tokenizer's batch call, which releases the GIL while it
    works (its encode holds it: 150k characters kept /health waiting ~0.5 s even off the loop)."""
    return codec.tok.encode_batch([text], add_special_tokens=False)[0].ids


def tenant_of(key: str) -> str:
    """A stable, non-secret name for an API key: the batcher keeps each tenant's prefixes apart."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def max_token_chars(codec: TextCodec) -> int:
    """An upper bound on the characters one token stands for: its vocabulary string's length (a
    byte-level string has one symbol per byte); x4 where a normalizer may merge characters."""
    longest = max((len(t) for t in codec.tok.get_vocab()), default=1)
    return longest * (4 if codec.tok.normalizer is not None else 1)


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
        from edgekv.runtime import grammar
        if self.bundle is None:
            raise ApiError(400, "this server was started without its bundle: tools, response_format and "
                                "logprobs are not available", code="unsupported_parameter")
        try:
            return grammar.tokenizer_for(self.bundle)
        except grammar.GrammarError as e:
            raise ApiError(400, str(e), code="unsupported_parameter") from None

    def stop_ids(self, constrained: bool) -> frozenset[int]:
        if not constrained:
            return frozenset(self.codec.stop_ids)
        from edgekv.runtime import grammar
        return frozenset(self.codec.stop_ids) | frozenset(grammar.stop_ids_of(self.bundle))

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
        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.guard(self.prom), methods=["GET"]),
            Route("/v1/models", self.guard(self.models), methods=["GET"]),
            Route("/v1/chat/completions", self.guard(self.chat), methods=["POST"]),
            Route("/v1/completions", self.guard(self.completions), methods=["POST"]),
        ], middleware=[Middleware(Front, server=self)],
            exception_handlers={404: self.not_found, 405: self.not_allowed})

    # -- plumbing
    def tenant(self, request: HttpRequest) -> str:
        """The caller's tenant; 401 unless it sent one of the keys (each compared in constant time)."""
        if not self.keys:
            return ""
        auth = request.headers.get("authorization", "").encode("latin-1")
        found = [t for k, t in self.keys if hmac.compare_digest(auth, b"Bearer " + k)]
        if not found:
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                           kind="authentication_error", code="invalid_api_key")
        return found[0]

    def guard(self, handler):
        """The API key check, and every error as OpenAI's JSON error."""
        async def wrapped(request: HttpRequest):
            endpoint = request.url.path
            try:
                request.state.tenant = self.tenant(request)
                resp = await handler(request)
            except ApiError as e:
                resp = e.response()
            except (ClientGone, ClientDisconnect):
                self.metrics.disconnect()
                resp = Response(status_code=499)  # nginx's "client closed request": for the log and metrics
            except Exception:
                log.exception("edgekv serve: %s %s failed", request.method, endpoint)
                resp = ApiError(500, "internal error (see the server log)", kind="server_error").response()
            self.metrics.request(endpoint, resp.status_code)
            return resp
        return wrapped

    async def not_found(self, request, exc):
        return ApiError(404, f"no route {request.url.path[:200]}", code="not_found").response()

    async def not_allowed(self, request, exc):
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                        headers=getattr(exc, "headers", None)).response()

    async def read_body(self, request: HttpRequest) -> bytes:
        """The raw body of a JSON POST, at most max_body_bytes (by Content-Length, then counted
        as it arrives, for chunked bodies and lying lengths)."""
        ctype = request.headers.get("content-type", "")
        media, *params = [p.strip().lower() for p in ctype.split(";")]
        charset = next((p[8:].strip('"') for p in params if p.startswith("charset=")), "utf-8")
        if media != "application/json" or charset not in ("utf-8", "utf8"):
            raise ApiError(415, f"the body must be sent as Content-Type: application/json (got {ctype[:80]!r})",
                           code="unsupported_media_type")
        too_big = ApiError(413, f"the request body is larger than {self.max_body_bytes} bytes (the server's "
                                "--max-body)", code="body_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise too_big
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise too_big
            parts.append(chunk)
        return b"".join(parts)

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
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                                         "owned_by": "edgekv"}]})

    async def chat(self, request: HttpRequest) -> Response:
        return await self.serve(request, self.chat_ask)

    async def completions(self, request: HttpRequest) -> Response:
        return await self.serve(request, self.completion_ask)

    def chat_ask(self, raw: bytes) -> ApiAsk:
        """Parse, check, render and tokenize a chat request (a worker thread)."""
        body = parse_json(raw)
        refuse_unsupported(body, CHAT_UNSUPPORTED)
        try:
            msgs = tools.chat_messages(body.get("messages"))
            top = structured.logprobs_asked(body, chat=True)
            structured_asked = any(body.get(f) not in (None, False, [], "none", {"type": "text"}) for f in STRUCTURED_FIELDS)
            constraint, plan = (tools.request_constraint(body, self.grammar_tokenizer()) if structured_asked
                                else (None, None))
        except structured.BadRequest as e:
            raise ApiError(400, str(e), param=e.param, code=e.code) from None
        opts = max_tokens_of(body), sampling_of(body, self.sampling_defaults), stops_of(body), _flag(body, "stream")
        kw = template_kwargs_of(body)
        self.check_length(sum(len(m.get("content") or "") for m in msgs), "messages")
        codec = self.codec.with_thinking(kw["enable_thinking"]) if "enable_thinking" in kw else self.codec
        try:
            text = tools.render_prompt(codec, msgs, plan, self.takes_tools)
        except EdgeKVError as e:
            raise ApiError(400, str(e), param="messages") from None
        # a reply held to a response_format starts with its JSON, whatever the prompt left open
        shaped = constraint is not None and plan is None
        return ApiAsk(encode_unlocked(self.codec, text), *opts, chat=True, constraint=constraint, plan=plan,
                      logprobs=top, include_usage=include_usage_of(body), split_reasoning=self.thinks,
                      in_reasoning=self.thinks and not shaped and opens_reasoning(text))

    def completion_ask(self, raw: bytes) -> ApiAsk:
        body = parse_json(raw)
        refuse_unsupported(body, COMPLETION_UNSUPPORTED)
        prompt = prompt_of(body)
        try:
            top = structured.logprobs_asked(body, chat=False)
        except structured.BadRequest as e:
            raise ApiError(400, str(e), param=e.param, code=e.code) from None
        if top is not None:
            self.grammar_tokenizer()  # its bytes of each token
        opts = max_tokens_of(body), sampling_of(body, self.sampling_defaults), stops_of(body), _flag(body, "stream")
        self.check_length(len(prompt), "prompt")
        return ApiAsk(encode_unlocked(self.codec, prompt), *opts, chat=False, logprobs=top,
                      include_usage=include_usage_of(body))

    async def serve(self, request: HttpRequest, prepare: Callable[[bytes], ApiAsk]) -> Response:
        if self.state != "ready":
            elsewhere = " (or on another server)" if self.state == "draining" else ""
            raise ApiError(503, f"the server is {self.state}; retry later{elsewhere}", kind="server_error",
                           code=f"server_{self.state}", headers={"Retry-After": str(RETRY_AFTER_S)})
        raw = await self.read_body(request)
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
            raise ApiError(413, f"{e}", code="context_length_exceeded",
                           param="messages" if ask.chat else "prompt") from None
        except QueueFull as e:
            raise ApiError(429, f"{e}; retry later", kind="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EdgeKVError as e:
            raise ApiError(400, str(e)) from None
        reply = Reply(self, req, queue, StopWatch(self.codec, ask.stops), ask, request.scope)
        self.live.add(reply, loop, queue)
        if ask.stream:
            return StreamingResponse(reply.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await reply.whole(request)


GONE = object()  # in a reply's queue beside the batcher's events: the client hung up


class Reply:
    """One request's answer, whole or as server-sent events; the batcher's request is cancelled
    whenever the answer ends early (a stop sequence, a client gone)."""

    def __init__(self, server: Server, req: Request, queue: asyncio.Queue, watch: StopWatch, ask: ApiAsk, scope: dict):
        self.server, self.req, self.queue, self.watch, self.chat = server, req, queue, watch, ask.chat
        self.api = ask  # the checked HTTP ask (self.req.ask: the batcher's)
        self.calls = ask.plan is not None and ask.plan.calls_possible  # the reply may hold tool calls
        # the streamed reply's <think> part told from its answer (None: no thinking template)
        self.split = ReasoningSplitter(ask.in_reasoning) if ask.split_reasoning else None
        self.entries: list = []  # sampling.TokenLogprob of each token, when logprobs were asked
        self.sent = 0  # entries already sent in a chunk
        self.model = server.model  # never the client's 'model' echoed back
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.completion_tokens = 0
        self.cached_tokens = 0  # of the prompt (the first token's event or the Done says)
        self.done: Done | None = None
        self.scope = scope  # the access log reads the token counts from its state

    async def events(self):
        """(text, finish_reason) pieces; finish_reason is set on the last."""
        try:
            while True:
                event = await self.queue.get()
                if isinstance(event, Token):
                    if event.ttft_s is not None:  # the first
                        self.server.metrics.first_token(event.ttft_s)
                        self.cached_tokens = event.cached_tokens
                    self.completion_tokens += 1
                    if event.logprob is not None:
                        self.entries.append(event.logprob)
                    text = self.watch.push(event.id)
                    if self.watch.stopped:
                        self.server.batcher.cancel(self.req)
                        yield text, "stop"
                        return
                    if text:
                        yield text, None
                elif event is GONE:
                    raise ClientGone()
                elif event is CUT:
                    self.scope.setdefault("state", {})["cut"] = True  # the access line says so
                    raise self.server.cut_error()
                else:
                    self.done, self.cached_tokens = event, event.usage.cached_tokens
                    if event.reason == "error":
                        raise ApiError(500, "generation failed (see the server log)",
                                       kind="server_error")
                    yield self.watch.flush(), "length" if event.reason == "length" else "stop"
                    return
        finally:
            self.scope.setdefault("state", {})["usage"] = (len(self.req.ask.prompt), self.completion_tokens)
            self.server.live.discard(self)
            if self.done is None:
                self.server.batcher.cancel(self.req)  # a client gone, or an early end: free its cells now

    def usage(self) -> dict:
        p = len(self.req.ask.prompt)
        return {"prompt_tokens": p, "completion_tokens": self.completion_tokens,
                "total_tokens": p + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    async def whole(self, request: HttpRequest) -> Response:
        """The whole answer; a client that hangs up meanwhile cancels its request (the body has
        been read, so the next message from the server is the disconnect)."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.queue.put_nowait(GONE)

        watcher = asyncio.create_task(watch())
        try:
            parts, finish = [], "stop"
            async for text, fin in self.events():
                parts.append(text)
                finish = fin or finish
        finally:
            watcher.cancel()
        text = "".join(parts)
        if self.chat:
            reasoning = None
            if self.api.split_reasoning:
                part = split_reply(text, self.api.in_reasoning)
                text, reasoning = part.content, part.reasoning or None
            msg = {"role": "assistant", "content": text}
            if self.calls:
                msg, _ = tools.parse_reply(text)
                finish = tools.finish_reason(finish, msg)
            if self.api.split_reasoning:
                msg["reasoning_content"] = reasoning
            choice = {"index": 0, "message": msg, "finish_reason": finish, "logprobs": self.logprobs(self.entries)}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": self.logprobs(self.entries)}
        return JSONResponse({"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()})

    def logprobs(self, entries: list) -> dict | None:
        """OpenAI's logprobs of these tokens (None when not asked)."""
        if self.api.logprobs is None:
            return None
        if self.chat:
            return structured.chat_logprobs(entries, self.server.token_bytes)
        return structured.completion_logprobs(entries, self.server.token_bytes)

    def chunk(self, text: str | None, finish: str | None, role: bool = False, delta: dict | None = None) -> str:
        """One SSE chunk: text (or a tool-call delta), with the logprobs of the tokens received since the last."""
        lp = self.logprobs(self.entries[self.sent:])
        self.sent = len(self.entries)
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        if finish:
            out["usage"] = self.usage()
        return f"data: {json.dumps(out)}\n\n"

    def usage_chunk(self) -> str:
        """stream_options.include_usage: OpenAI's last chunk, no choices and the usage."""
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [], "usage": self.usage()}
        return f"data: {json.dumps(out)}\n\n"

    async def sse(self):
        if self.chat:
            yield self.chunk(None, None, role=True)
        pieces = self.tool_sse() if self.calls else self.text_sse()
        try:
            async for chunk in pieces:
                yield chunk
            if self.api.include_usage:
                yield self.usage_chunk()
        except ApiError as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind, 'code': e.code}})}\n\n"
        yield "data: [DONE]\n\n"

    def reasoned(self, text: str, final: bool) -> tuple[dict | None, str]:
        """(a reasoning_content delta or None, the answer's text) of a streamed piece; `final`:
        the reply's last piece (what the splitter held back comes out)."""
        if self.split is None:
            return None, text
        part = self.split.push(text)
        if final:
            tail = self.split.flush()
            part = type(part)(part.reasoning + tail.reasoning, part.content + tail.content)
        return ({"reasoning_content": part.reasoning} if part.reasoning else None), part.content

    async def text_sse(self):
        async for text, fin in self.events():
            thought, text = self.reasoned(text, fin is not None)
            if thought:
                yield self.chunk(None, None, delta=thought)
            if not text and fin is None:  # all of it reasoning (or held back)
                continue
            if text and fin:
                yield self.chunk(text, None)
                yield self.chunk(None, fin)
            else:
                yield self.chunk(text, fin)

    async def tool_sse(self):
        """The text through a ToolStream: each delta a chunk; finish_reason tool_calls when the
        reply stopped after its calls."""
        ts = tools.ToolStream()
        finish = "stop"
        async for text, fin in self.events():
            thought, text = self.reasoned(text, fin is not None)
            if thought:
                yield self.chunk(None, None, delta=thought)
            for d in ts.feed(text) if text else []:
                yield self.chunk(None, None, delta=d)
            finish = fin or finish
        for d in ts.finish():
            yield self.chunk(None, None, delta=d)
        yield self.chunk(None, "tool_calls" if finish == "stop" and ts.n_calls else finish)


def host_of(headers: list) -> str | None:
    """The host name a request's Host header names, without its port (None: no Host header)."""
    raw = next((v for k, v in headers if k == b"host"), None)
    if raw is None:
        return None
    host = raw.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if ":" in host else host


class Front:
    """ASGI middleware in front of every route: the Host check of a local bind (a web page that
    points a name it controls at 127.0.0.1 sends that name), and one access-log line per request."""

    def __init__(self, app, server: Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [None]

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            host = host_of(scope["headers"])
            if self.server.check_host and host is not None and host not in LOCAL_NAMES:
                await ApiError(421, f"this server listens on a local address and answers only requests for "
                                    f"{sorted(LOCAL_NAMES)}, not {host[:100]!r}",
                               code="host_not_allowed").response()(scope, receive, send_logged)
            else:
                await self.app(scope, receive, send_logged)
        finally:
            p, c = scope.get("state", {}).get("usage", ("-", "-"))
            cut = " cut" if scope.get("state", {}).get("cut") else ""  # ended by the drain (serve/drain.py)
            log.info("%s %s %s prompt=%s completion=%s %.3fs", scope["method"], scope["path"][:200],
                     f"{status[0] or '-'}{cut}", p, c, time.perf_counter() - t0)
