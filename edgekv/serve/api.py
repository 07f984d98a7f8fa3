"""What every API of the server shares: which API a request came through (`Api`: it picks the
error shape and the response format), the error every handler raises (`ApiError`, rendered in
the caller's API's shape; `bad_request` makes its 400s), and the two requests of the one engine
underneath: `ChatAsk` (any chat-like API's request, translated: checked messages and OpenAI-shaped
tool / format fields) and `ApiAsk` (rendered and tokenized, ready to submit)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from starlette.responses import JSONResponse

from edgekv.runtime.sampling import SamplingParams


class Api(enum.Enum):
    """The response format of a request (and the shape of its errors)."""
    COMPLETIONS = "completions"  # OpenAI's /v1/completions: a raw prompt, no template
    CHAT = "chat"  # OpenAI's /v1/chat/completions
    MESSAGES = "messages"  # Anthropic's /v1/messages
    RESPONSES = "responses"  # OpenAI's /v1/responses (stateless)


# Anthropic's error type of each status (docs.anthropic.com, "Errors"); 503 (loading, draining)
# and a full queue are the "overloaded" a client retries
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                   413: "request_too_large", 415: "invalid_request_error", 421: "permission_error",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


class ApiError(Exception):
    """An HTTP error for this request: its status, OpenAI's error type (`kind`), the request field
    it is about (`param`), a machine-readable `code` and extra response headers. A 400 (a field that
    cannot be served as asked) is made by bad_request."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code, self.headers = status, kind, param, code, headers

    def anthropic_status(self) -> int:
        # a prompt longer than the context is Anthropic's 400 "prompt is too long", not a body size
        return 400 if self.code == "context_length_exceeded" else self.status

    def body(self, api: Api = Api.CHAT) -> dict:
        if api is Api.MESSAGES:
            status = self.anthropic_status()
            return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": str(self)}}
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, api: Api = Api.CHAT) -> JSONResponse:
        status = self.anthropic_status() if api is Api.MESSAGES else self.status
        return JSONResponse(self.body(api), status_code=status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """The 400 of a request that cannot be served as asked, naming the field (`param`) at fault."""
    return ApiError(400, message, param=param, code=code)


class ClientGone(Exception):
    """The client hung up before its whole answer was ready."""


@dataclass
class ChatAsk:
    """A chat-like request translated from its API, before the template: `messages` checked as
    tools.chat_messages returns them; `structured` the OpenAI chat fields tools.request_constraint
    reads (tools, tool_choice, parallel_tool_calls, response_format); `param` the request field
    the messages came from (errors name it)."""
    messages: list[dict]
    max_tokens: int
    params: SamplingParams
    stops: list[str]
    stream: bool
    structured: dict = field(default_factory=dict)
    logprobs: int | None = None
    include_usage: bool = False
    thinking: bool | None = None  # enable_thinking for the template (None: the template's default)
    param: str = "messages"
    echo: dict = field(default_factory=dict)  # request fields a response format repeats back
    prefill: str = ""  # a final assistant turn the reply continues (Anthropic's prefill)


@dataclass
class ApiAsk:
    """A checked request, ready to submit."""
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    stops: list[str]
    stream: bool
    api: Api
    constraint: object = None  # a GrammarConstraint (response_format or tools), None: free
    plan: object = None  # the request's tools.ToolPlan (None: no tools)
    logprobs: int | None = None  # alternatives per token (None: no logprobs)
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    split_reasoning: bool = False  # the template thinks: the reply's <think> part is reasoning
    in_reasoning: bool = False  # the prompt leaves a <think> open: the reply starts in its reasoning
    param: str = "messages"  # the field a context overflow names
    echo: dict = field(default_factory=dict)  # request fields a response format repeats back
