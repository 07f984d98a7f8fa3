"""OpenAI's chat and completions APIs: the request fields checked into a ChatAsk (chat) or an
ApiAsk (completions: a raw prompt, no template), and the reply rendered as OpenAI's
`chat.completion` / `text_completion`, whole or as `data:` chunks ending with `data: [DONE]`.
With stream_options.include_usage the usage comes in one last chunk with empty `choices`, as
OpenAI sends it (no other chunk carries it)."""
from __future__ import annotations

import json
import time
import uuid

from edgekv.runtime.sampling import SamplingDefaults
from edgekv.serve import structured, tools
from edgekv.serve.api import Api, ApiError, ChatAsk
from edgekv.serve.fields import (CHAT_UNSUPPORTED, flag, include_usage_of, max_tokens_of, refuse_unsupported,
                                 sampling_of, stops_of, template_kwargs_of)
from edgekv.serve.reply import Delta, Outcome, Reply

STRUCTURED = ("tools", "tool_choice", "parallel_tool_calls", "response_format")


def chat_request(body: dict, unset: SamplingDefaults) -> ChatAsk:
    """A chat request's fields, checked (the worker thread: no template, no tokenizer yet)."""
    refuse_unsupported(body, CHAT_UNSUPPORTED)
    msgs = tools.chat_messages(body.get("messages"))
    top = structured.logprobs_asked(body, chat=True)
    ask = ChatAsk(msgs, max_tokens_of(body), sampling_of(body, unset), stops_of(body), flag(body, "stream"),
                  structured={k: body.get(k) for k in STRUCTURED}, logprobs=top, include_usage=include_usage_of(body))
    ask.thinking = template_kwargs_of(body).get("enable_thinking")
    return ask


def openai_delta(d: Delta) -> dict:
    """A Delta as OpenAI's chat `delta`."""
    if d.kind == "reasoning":
        return {"reasoning_content": d.text}
    if d.kind == "content":
        return {"content": d.text}
    if d.kind == "call":
        return {"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                "function": {"name": d.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}


class ChatFormat:
    """OpenAI's chat.completion (Api.CHAT) or text_completion (Api.COMPLETIONS) of one reply."""

    def __init__(self, reply: Reply):
        self.reply, self.api = reply, reply.ask
        self.chat = reply.ask.api is Api.CHAT
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.object = "chat.completion" if self.chat else "text_completion"
        self.created = int(time.time())
        self.sent = 0  # logprob entries already sent in a chunk

    def usage(self) -> dict:
        r = self.reply
        return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                "total_tokens": r.prompt_tokens + r.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}

    def logprobs(self, entries: list) -> dict | None:
        """OpenAI's logprobs of these tokens (None when not asked)."""
        if self.api.logprobs is None:
            return None
        fn = structured.chat_logprobs if self.chat else structured.completion_logprobs
        return fn(entries, self.reply.server.token_bytes)

    def whole(self, out: Outcome) -> dict:
        lp = self.logprobs(self.reply.entries)
        if self.chat:
            msg = out.message if out.message is not None else {"role": "assistant", "content": out.content}
            if self.api.split_reasoning:
                msg["reasoning_content"] = out.reasoning
            choice = {"index": 0, "message": msg, "finish_reason": out.finish, "logprobs": lp}
        else:
            choice = {"index": 0, "text": out.content, "finish_reason": out.finish, "logprobs": lp}
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.reply.model,
                "choices": [choice], "usage": self.usage()}

    def chunk(self, delta: dict | None, finish: str | None = None) -> str:
        """One SSE chunk, with the logprobs of the tokens received since the last."""
        entries = self.reply.entries
        lp = self.logprobs(entries[self.sent:])
        self.sent = len(entries)
        if self.chat:
            choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": 0, "text": (delta or {}).get("content", ""), "finish_reason": finish, "logprobs": lp}
        return self.event({"choices": [choice]})

    def event(self, fields: dict) -> str:
        out = {"id": self.id, "object": self.object + ("" if not self.chat else ".chunk"), "created": self.created,
               "model": self.reply.model, **fields}
        return f"data: {json.dumps(out)}\n\n"

    async def sse(self):
        if self.chat:
            yield self.chunk({"role": "assistant", "content": ""})
        try:
            async for d in self.reply.deltas():
                yield self.chunk(openai_delta(d))
            yield self.chunk(None, self.reply.finish)
            if self.api.include_usage:  # OpenAI's last chunk: no choices, the usage
                yield self.event({"choices": [], "usage": self.usage()})
        except ApiError as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': e.kind, 'code': e.code}})}\n\n"
        yield "data: [DONE]\n\n"
