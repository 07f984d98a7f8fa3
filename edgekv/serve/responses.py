"""OpenAI's Responses API (POST /v1/responses), stateless, over the same engine as the chat API:
`instructions` + `input` (a string, or message / function_call / function_call_output /
reasoning items) -> the chat API's checked messages; function tools, tool_choice and
`text.format` -> its tools and response_format fields; the reply rendered as a `response` of
output items (reasoning, message, function_call), whole or as the Responses event stream
(response.created ... response.completed, each event with its sequence_number). Nothing is
stored: `store` is false, and `previous_response_id` is refused by name."""
from __future__ import annotations

import json
import time
import uuid

from edgekv.runtime.sampling import SamplingDefaults
from edgekv.serve import tools
from edgekv.serve.api import ApiError, ChatAsk
from edgekv.serve.fields import absent_or, flag, number, refuse_unsupported, sampling_of, text
from edgekv.serve.reply import Delta, Outcome, Reply

STATELESS = "this server keeps no responses (store is false): send the whole conversation in 'input'"
UNSUPPORTED = {
    "store": (absent_or(False), f"false or null: {STATELESS}"),
    "background": (absent_or(False), "false or null"),
    "max_tool_calls": (absent_or(), "null"),
    "top_logprobs": (absent_or(0), "0 or null"),
}
ROLES = ("user", "system", "developer", "assistant")
PART_TYPES = ("input_text", "output_text", "text")
ECHO = ("instructions", "max_output_tokens", "temperature", "top_p", "tool_choice", "tools", "parallel_tool_calls",
        "metadata")


def _bad(message: str, param: str = "input") -> ApiError:
    return ApiError(400, message, param=param)


def _content(c, where: str, param: str = "input") -> str:
    if isinstance(c, str):
        return text(c, param)
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") in PART_TYPES
                                   and isinstance(p.get("text"), str) for p in c):
        return text("".join(p["text"] for p in c), param)
    raise _bad(f"{where} must be a string or a list of input_text parts (images and files are not supported)", param)


def chat_messages_of(body: dict) -> list[dict]:
    """instructions + input -> the chat API's checked messages. A function_call joins the
    assistant message before it (parallel calls are one assistant turn)."""
    out: list[dict] = []
    if body.get("instructions") is not None:
        out.append({"role": "system", "content": _content(body["instructions"], "'instructions'", "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("'input' must be a non-empty string or list of items")
    for i, it in enumerate(items):
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message" and it.get("role") in ROLES:
            out.append({"role": it["role"], "content": _content(it.get("content"), f"input[{i}].content")})
        elif kind == "function_call" and all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": it["call_id"], "type": "function", "function": {"name": it["name"],
                                                                           "arguments": it["arguments"]}}
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output" and isinstance(it.get("call_id"), str):
            out.append({"role": "tool", "tool_call_id": it["call_id"],
                        "content": _content(it.get("output"), f"input[{i}].output")})
        elif kind != "reasoning":  # an earlier turn's reasoning: left out, as the templates drop it
            raise _bad(f"input[{i}] must be a message (role {', '.join(ROLES)}), function_call (call_id, name, "
                       f"arguments) or function_call_output (call_id, output) item; not {str(kind)[:40]!r}")
    try:
        return tools.chat_messages(out)
    except ApiError as e:  # the checked messages came from 'input'
        raise _bad(f"input: {e}") from None


def structured_of(body: dict) -> dict:
    """tools, tool_choice, parallel_tool_calls and text.format as the chat API's fields."""
    out: dict = {"parallel_tool_calls": body.get("parallel_tool_calls")}
    raw = body.get("tools")
    if raw is not None:
        if not isinstance(raw, list) or not all(isinstance(t, dict) and t.get("type") == "function" for t in raw):
            raise _bad("'tools' must be a list of function tools {type: function, name, parameters} (built-in "
                       "tools are not supported)", "tools")
        out["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                           "strict") if k in t}} for t in raw]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad('\'tool_choice\' must be "auto", "none", "required" or {"type": "function", "name": ...}',
                       "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if raw or choice not in (None, "auto", "none"):  # (a client's default "auto" needs no tools)
        out["tool_choice"] = choice
    fmt = body.get("text")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise _bad("'text' must be an object {format: ...}", "text")
        f = fmt.get("format")
        if isinstance(f, dict) and f.get("type") == "json_schema":
            f = {"type": "json_schema", "json_schema": {k: f[k] for k in ("name", "schema", "strict", "description")
                                                        if k in f}}
        out["response_format"] = f
    return out


def thinking_of(body: dict) -> bool | None:
    """`reasoning.effort` for a thinking template: "none" turns the thinking off."""
    r = body.get("reasoning")
    if r is None:
        return None
    if not isinstance(r, dict):
        raise _bad("'reasoning' must be an object {effort: ...}", "reasoning")
    return None if r.get("effort") is None else r["effort"] != "none"


def responses_request(body: dict, unset: SamplingDefaults) -> ChatAsk:
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise ApiError(400, f"'{name}' is not supported: {STATELESS}", param=name, code="unsupported_parameter")
    refuse_unsupported(body, UNSUPPORTED)
    ask = ChatAsk(chat_messages_of(body), number(body, "max_output_tokens", 256, 1, 1 << 20, integer=True),
                  sampling_of(body, unset), [], flag(body, "stream"), structured=structured_of(body), param="input")
    ask.thinking = thinking_of(body)
    ask.echo = {k: body.get(k) for k in ECHO} | {"max_output_tokens": ask.max_tokens,  # the limit it ran under
                                                  "text": body.get("text") or {"format": {"type": "text"}},
                                                  "temperature": ask.params.temperature, "top_p": ask.params.top_p}
    return ask


class ResponsesFormat:
    """OpenAI's `response` of one reply, whole or as its event stream."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.seq = 0
        self.items: list[dict] = []  # the output items, as far as streamed
        self.open: dict | None = None  # the item being streamed

    def usage(self) -> dict:
        r = self.reply
        return {"input_tokens": r.prompt_tokens, "input_tokens_details": {"cached_tokens": r.cached_tokens},
                "output_tokens": r.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": r.prompt_tokens + r.completion_tokens}

    def response(self, status: str, output: list, usage: dict | None) -> dict:
        echo = self.reply.ask.echo
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.reply.model, "output": output, "previous_response_id": None, "store": False,
                "reasoning": {"effort": None, "summary": None}, "truncation": "disabled", "usage": usage,
                **{k: echo.get(k) for k in ECHO}, "tool_choice": echo.get("tool_choice") or "auto",
                "tools": echo.get("tools") or [], "parallel_tool_calls": echo.get("parallel_tool_calls") is not False,
                "metadata": echo.get("metadata") or {}, "text": echo.get("text")}

    def status(self) -> str:
        return "incomplete" if self.reply.finish == "length" else "completed"

    @staticmethod
    def reasoning_item(text: str, status: str = "completed") -> dict:
        return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:24], "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}

    @staticmethod
    def message_item(text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
        return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    def whole(self, out: Outcome) -> dict:
        items = [self.reasoning_item(out.reasoning)] if out.reasoning else []
        if out.content or not out.calls:
            items.append(self.message_item(out.content))
        items += [self.call_item(c["id"], c["name"], c["arguments"]) for c in out.calls]
        if self.status() == "incomplete":  # the item the limit cut
            items[-1]["status"] = "incomplete"
        return self.response(self.status(), items, self.usage())

    def event(self, kind: str, data: dict) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **data})}\n\n"

    def start(self, item: dict) -> list[str]:
        out = self.finish_item()
        self.open = item
        item["status"] = "in_progress"
        idx = len(self.items)
        shown = {**item, "content": []} if item["type"] in ("message", "reasoning") else {**item, "arguments": ""}
        out.append(self.event("response.output_item.added", {"output_index": idx, "item": shown}))
        if item["type"] in ("message", "reasoning"):
            part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []} if item["type"] == "message"
                    else {"type": "reasoning_text", "text": ""})
            out.append(self.event("response.content_part.added", {
                "item_id": item["id"], "output_index": idx, "content_index": 0, "part": part}))
        return out

    def finish_item(self, last: bool = False) -> list[str]:
        """Close the open item; `last`: the reply's end (a reply the limit cut leaves it incomplete)."""
        item, self.open = self.open, None
        if item is None:
            return []
        idx, at = len(self.items), {"item_id": item["id"], "output_index": len(self.items)}
        item["status"] = "incomplete" if last and self.status() == "incomplete" else "completed"
        self.items.append(item)
        if item["type"] == "message":
            part = item["content"][0]
            out = [self.event("response.output_text.done", {**at, "content_index": 0, "text": part["text"],
                                                             "logprobs": []}),
                   self.event("response.content_part.done", {**at, "content_index": 0, "part": part})]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out = [self.event("response.reasoning_text.done", {**at, "content_index": 0, "text": part["text"]}),
                   self.event("response.content_part.done", {**at, "content_index": 0, "part": part})]
        else:
            out = [self.event("response.function_call_arguments.done", {**at, "name": item["name"],
                                                                         "arguments": item["arguments"]})]
        return out + [self.event("response.output_item.done", {"output_index": idx, "item": item})]

    def pieces(self, d: Delta) -> list[str]:
        kind = {"reasoning": "reasoning", "content": "message"}.get(d.kind)
        out = []
        if d.kind == "call":
            return self.start(self.call_item(d.id, d.name, ""))
        if kind is not None and (self.open is None or self.open["type"] != kind):
            out = self.start(self.reasoning_item("") if kind == "reasoning" else self.message_item(""))
        at = {"item_id": self.open["id"], "output_index": len(self.items)}
        if d.kind == "args":
            self.open["arguments"] += d.text
            return out + [self.event("response.function_call_arguments.delta", {**at, "delta": d.text})]
        self.open["content"][0]["text"] += d.text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return out + [self.event(name, {**at, "content_index": 0, "delta": d.text, **extra})]

    async def sse(self):
        yield self.event("response.created", {"response": self.response("in_progress", [], None)})
        yield self.event("response.in_progress", {"response": self.response("in_progress", [], None)})
        try:
            async for d in self.reply.deltas():
                for piece in self.pieces(d):
                    yield piece
            for piece in self.finish_item(last=True):
                yield piece
            if all(i["type"] == "reasoning" for i in self.items):  # no answer: one empty message, as whole
                for piece in self.start(self.message_item("")) + self.finish_item():
                    yield piece
            status = self.status()
            yield self.event(f"response.{status}", {"response": self.response(status, self.items, self.usage())})
        except ApiError as e:
            yield self.event("error", {"code": e.code or e.kind, "message": str(e), "param": e.param})
            failed = {**self.response("failed", self.items, None), "error": {"code": e.code or e.kind, "message": str(e)}}
            yield self.event("response.failed", {"response": failed})
