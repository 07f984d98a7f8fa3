"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the same engine
as the chat API: the request is translated into the ChatAsk the chat API builds (system and
messages -> checked chat messages; tool_use / tool_result blocks -> assistant tool calls / tool
results; tools, tool_choice -> the chat API's tools fields; `thinking` -> enable_thinking), and
the reply is rendered as Anthropic's `message`, whole or as its event stream: message_start,
ping, content_block_start / content_block_delta / content_block_stop per block (thinking, text,
tool_use), message_delta (stop_reason, usage), message_stop."""
from __future__ import annotations

import json
import uuid

from edgekv.runtime.sampling import SamplingDefaults
from edgekv.serve import tools
from edgekv.serve.api import Api, ApiError, ChatAsk
from edgekv.serve.fields import absent_or, flag, number, refuse_unsupported, sampling_of, stops_of, text
from edgekv.serve.reply import Delta, Outcome, Reply

MAX_STOP_SEQUENCES = 16
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's -> the chat API's
# fields that would change the answer and are not implemented: refused by name, never ignored
UNSUPPORTED = {"container": (absent_or(), "null"), "mcp_servers": (absent_or(), "null")}


def _bad(message: str, param: str = "messages") -> ApiError:
    return ApiError(400, message, param=param)


def _text_blocks(content, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(content, str):
        return text(content, where)
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return text("".join(b["text"] for b in content), where)
    raise _bad(f"{where} must be a string or a list of text blocks", where.split("[")[0].split(".")[0])


def _blocks(m: dict, i: int) -> list[dict]:
    c = m.get("content")
    if isinstance(c, str):
        return [{"type": "text", "text": c}]
    if not isinstance(c, list) or not all(isinstance(b, dict) for b in c):
        raise _bad(f"messages[{i}].content must be a string or a list of content blocks")
    return c


def _user(m: dict, i: int) -> list[dict]:
    """A user turn: its tool_result blocks as tool messages (first, as Anthropic orders them),
    then its text as one user message."""
    results, parts = [], []
    for j, b in enumerate(_blocks(m, i)):
        where = f"messages[{i}].content[{j}]"
        if b.get("type") == "text" and isinstance(b.get("text"), str):
            parts.append(text(b["text"], "messages"))
        elif b.get("type") == "tool_result" and isinstance(b.get("tool_use_id"), str):
            out = "" if b.get("content") is None else _text_blocks(b["content"], f"{where}.content")
            if b.get("is_error") is True:
                out = f"Error: {out}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": out})
        else:
            raise _bad(f"{where}: only text and tool_result blocks are supported in a user turn "
                       f"(not {str(b.get('type'))[:40]!r})")
    return results + ([{"role": "user", "content": "".join(parts)}] if parts or not results else [])


def _assistant(m: dict, i: int) -> dict:
    """An assistant turn: its text, and its tool_use blocks as calls; thinking blocks are left
    out (the templates drop an earlier turn's reasoning too)."""
    parts, calls = [], []
    for j, b in enumerate(_blocks(m, i)):
        kind = b.get("type")
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append(text(b["text"], "messages"))
        elif kind == "tool_use" and isinstance(b.get("id"), str) and isinstance(b.get("name"), str) \
                and isinstance(b.get("input"), dict):
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise _bad(f"messages[{i}].content[{j}]: an assistant turn holds text, tool_use (id, name, input) "
                       f"and thinking blocks (not {str(kind)[:40]!r})")
    msg = {"role": "assistant", "content": "".join(parts) or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return msg


def chat_messages_of(body: dict) -> list[dict]:
    """system + messages -> the chat API's checked messages."""
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_blocks(body["system"], "system")})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"messages[{i}] must be an object with a role of user or assistant")
        out += _user(m, i) if m["role"] == "user" else [_assistant(m, i)]
    return tools.chat_messages(out)


def tools_of(body: dict) -> dict:
    """tools and tool_choice as the chat API's fields."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    out: dict = {}
    if raw is not None:
        if not isinstance(raw, list):
            raise _bad("'tools' must be a list", "tools")
        out["tools"] = []
        for i, t in enumerate(raw):
            if not isinstance(t, dict) or t.get("type") not in (None, "custom") or "input_schema" not in t:
                raise _bad(f"tools[{i}] must be a client tool {{name, description, input_schema}} (server tools "
                           "are not supported)", "tools")
            fn = {"name": t.get("name"), "parameters": t["input_schema"]}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            out["tools"].append({"type": "function", "function": fn})
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool" and isinstance(choice.get("name"), str):
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in TOOL_CHOICES:
            out["tool_choice"] = TOOL_CHOICES[kind]
        else:
            raise _bad('\'tool_choice\' must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}',
                       "tool_choice")
        if choice.get("disable_parallel_tool_use") is not None:
            out["parallel_tool_calls"] = not flag(choice, "disable_parallel_tool_use")
    return out


def thinking_of(body: dict) -> bool:
    """Anthropic's thinking is off unless asked for: a thinking template then answers without it."""
    t = body.get("thinking")
    if t is None:
        return False
    if not isinstance(t, dict) or t.get("type") not in ("enabled", "disabled", "adaptive"):
        raise _bad("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}",
                   "thinking")
    return t["type"] != "disabled"


def prefill_of(body: dict) -> tuple[dict, str]:
    """(the body without its final assistant turn, that turn's text): Anthropic continues a
    conversation that ends in an assistant turn from where it stops (a "prefill")."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or len(msgs) < 2 or not isinstance(msgs[-1], dict) \
            or msgs[-1].get("role") != "assistant":
        return body, ""
    last = _assistant(msgs[-1], len(msgs) - 1)
    if last.get("tool_calls"):
        raise _bad("a final assistant turn with tool_use blocks cannot be continued: send its tool_result")
    return {**body, "messages": msgs[:-1]}, last["content"] or ""


def output_format_of(body: dict) -> dict:
    """Structured outputs (`output_config.format`, or the beta's `output_format`) as the chat
    API's response_format."""
    config = body.get("output_config")
    if config is not None and (not isinstance(config, dict) or set(config) - {"format"}):
        raise _bad("'output_config' takes only 'format' here", "output_config")
    fmt = (config or {}).get("format", body.get("output_format"))
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_config")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}}


def messages_request(body: dict, unset: SamplingDefaults, counting: bool = False) -> ChatAsk:
    """A Messages request as the chat API's ChatAsk (`counting`: count_tokens, no max_tokens)."""
    max_tokens = number(body, "max_tokens", None, 1, 1 << 20, integer=True)
    if max_tokens is None and not counting:
        raise _bad("'max_tokens' is required", "max_tokens")
    refuse_unsupported(body, UNSUPPORTED)
    rest, prefill = prefill_of(body)
    ask = ChatAsk(chat_messages_of(rest), max_tokens or 1, sampling_of(body, unset),
                  stops_of(body, "stop_sequences", MAX_STOP_SEQUENCES), flag(body, "stream"),
                  structured=tools_of(body) | output_format_of(body))
    ask.thinking, ask.prefill = thinking_of(body), prefill
    return ask


def stop_reason(reply: Reply) -> str:
    if reply.finish == "tool_calls":
        return "tool_use"
    if reply.finish == "length":
        return "max_tokens"
    return "stop_sequence" if reply.stop_sequence is not None else "end_turn"


def tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict:
    try:
        v = json.loads(arguments)
    except ValueError:  # a call cut by max_tokens: stop_reason says so
        return {}
    return v if isinstance(v, dict) else {}


class MessagesFormat:
    """Anthropic's `message` of one reply, whole or streamed."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.block: str | None = None  # the kind of the content block open while streaming
        self.index = -1

    def usage(self) -> dict:
        r = self.reply
        return {"input_tokens": r.prompt_tokens - r.cached_tokens, "output_tokens": r.completion_tokens,
                "cache_read_input_tokens": r.cached_tokens, "cache_creation_input_tokens": 0}

    def message(self, content: list, stop: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.reply.model, "content": content,
                "stop_reason": stop, "stop_sequence": self.reply.stop_sequence if stop == "stop_sequence" else None,
                "usage": usage}

    def whole(self, out: Outcome) -> dict:
        content = []
        if out.reasoning:
            content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
        if out.content or not (out.calls or out.reasoning):
            content.append({"type": "text", "text": out.content})
        content += [{"type": "tool_use", "id": tool_id(c["id"]), "name": c["name"], "input": _input(c["arguments"])}
                    for c in out.calls]
        return self.message(content, stop_reason(self.reply), self.usage())

    @staticmethod
    def event(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    def open(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.block, self.index = kind, self.index + 1
        return out + [self.event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.block is None:
            return []
        out = []
        if self.block == "thinking":
            out.append(self.delta({"type": "signature_delta", "signature": ""}))
        self.block = None
        return out + [self.event("content_block_stop", {"index": self.index})]

    def delta(self, d: dict) -> str:
        return self.event("content_block_delta", {"index": self.index, "delta": d})

    def pieces(self, d: Delta) -> list[str]:
        if d.kind == "reasoning":
            out = [] if self.block == "thinking" else self.open("thinking", {"type": "thinking", "thinking": "",
                                                                             "signature": ""})
            return out + [self.delta({"type": "thinking_delta", "thinking": d.text})]
        if d.kind == "content":
            out = [] if self.block == "text" else self.open("text", {"type": "text", "text": ""})
            return out + [self.delta({"type": "text_delta", "text": d.text})]
        if d.kind == "call":
            return self.open("tool_use", {"type": "tool_use", "id": tool_id(d.id), "name": d.name, "input": {}})
        return [self.delta({"type": "input_json_delta", "partial_json": d.text})]

    async def sse(self):
        r = self.reply
        start = {"input_tokens": r.prompt_tokens, "output_tokens": 0, "cache_read_input_tokens": 0,
                 "cache_creation_input_tokens": 0}  # the cached part is known with the first token
        yield self.event("message_start", {"message": self.message([], None, start)})
        yield self.event("ping", {})
        try:
            async for d in r.deltas():
                for piece in self.pieces(d):
                    yield piece
            if self.index < 0:  # nothing said: one empty text block, as a whole reply has
                for piece in self.open("text", {"type": "text", "text": ""}):
                    yield piece
            for piece in self.close():
                yield piece
            stop = stop_reason(r)
            said = r.stop_sequence if stop == "stop_sequence" else None
            yield self.event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": said},
                                               "usage": self.usage()})
            yield self.event("message_stop", {})
        except ApiError as e:
            yield self.event("error", {"error": e.body(Api.MESSAGES)["error"]})
