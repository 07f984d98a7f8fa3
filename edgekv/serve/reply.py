"""One request's reply, whatever API asked: the batcher's events -> text cut at the stop strings ->
its reasoning told from its answer -> tool calls told from text. What comes out is format-neutral,
whole (`Outcome`) or streamed (`Delta`s); each API's response format (serve/chat.py, messages.py,
responses.py) renders it. The batcher's request is cancelled whenever the answer ends early (a
stop string, a client gone)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from starlette.requests import Request as HttpRequest

from edgekv.runtime.batching import Done, Request, Token
from edgekv.runtime.reasoning import ReasoningSplitter, split_reply
from edgekv.serve.api import ApiAsk, ApiError, ClientGone
from edgekv.serve.drain import CUT
from edgekv.serve.stops import StopWatch
from edgekv.serve.tool_stream import ToolStream, finish_reason, parse_reply

GONE = object()  # in a reply's queue beside the batcher's events: the client hung up


@dataclass
class Delta:
    """A piece of a streamed reply: "reasoning" or "content" text, a tool "call" starting (its
    index, id and name), or a piece of a call's "args" (its index)."""
    kind: str
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


@dataclass
class Outcome:
    """A whole reply: its reasoning (None: no thinking template, or none said), its text, its
    complete tool calls ({"id", "name", "arguments": JSON text}) and why it ended: "stop" (a stop
    token or string), "length" or "tool_calls"."""
    content: str
    finish: str
    reasoning: str | None = None
    calls: list[dict] = field(default_factory=list)
    message: dict | None = None  # the OpenAI chat message, when tools were offered


def delta_of(d: dict) -> list[Delta]:
    """tools.ToolStream's OpenAI delta as Deltas."""
    if "content" in d:
        return [Delta("content", d["content"])]
    out = []
    for c in d.get("tool_calls", []):
        if "id" in c:
            out.append(Delta("call", index=c["index"], id=c["id"], name=c["function"]["name"]))
        if c["function"].get("arguments"):
            out.append(Delta("args", c["function"]["arguments"], index=c["index"]))
    return out


class Reply:
    def __init__(self, server, req: Request, queue: asyncio.Queue, ask: ApiAsk, scope: dict):
        self.server, self.req, self.queue, self.ask = server, req, queue, ask
        self.watch = StopWatch(server.codec, ask.stops)
        self.calls = ask.plan is not None and ask.plan.calls_possible  # the reply may hold tool calls
        # the streamed reply's <think> part told from its answer (None: no thinking template)
        self.split = ReasoningSplitter(ask.in_reasoning) if ask.split_reasoning else None
        self.entries: list = []  # sampling.TokenLogprob of each token, when logprobs were asked
        self.model = server.model  # never the client's 'model' echoed back
        self.completion_tokens = 0
        self.cached_tokens = 0  # of the prompt (the first token's event or the Done says)
        self.done: Done | None = None
        self.finish = "stop"  # once streamed: how the reply ended (Outcome.finish)
        self.scope = scope  # the access log reads the token counts from its state

    @property
    def prompt_tokens(self) -> int:
        return len(self.req.ask.prompt)

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the reply, if one did."""
        return self.watch.matched

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
                        raise ApiError(500, "generation failed (see the server log)", kind="server_error")
                    yield self.watch.flush(), "length" if event.reason == "length" else "stop"
                    return
        finally:
            self.scope.setdefault("state", {})["usage"] = (len(self.req.ask.prompt), self.completion_tokens)
            self.server.live.discard(self)
            if self.done is None:
                self.server.batcher.cancel(self.req)  # a client gone, or an early end: free its cells now

    async def outcome(self, request: HttpRequest) -> Outcome:
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
        text, reasoning = "".join(parts), None
        if self.ask.split_reasoning:
            part = split_reply(text, self.ask.in_reasoning)
            text, reasoning = part.content, part.reasoning or None
        if not self.calls:
            self.finish = finish
            return Outcome(text, finish, reasoning)
        msg, _ = parse_reply(text)
        self.finish = finish_reason(finish, msg)
        calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in msg.get("tool_calls", [])]
        return Outcome(msg["content"] or "", self.finish, reasoning, calls, msg)

    def reasoned(self, text: str, final: bool) -> tuple[str, str]:
        """(the reasoning, the answer's text) of a streamed piece; `final`: the reply's last piece
        (what the splitter held back comes out)."""
        if self.split is None:
            return "", text
        part = self.split.push(text)
        if final:
            tail = self.split.flush()
            part = type(part)(part.reasoning + tail.reasoning, part.content + tail.content)
        return part.reasoning, part.content

    async def deltas(self):
        """The reply as Deltas while it streams; `finish` is set once they end. With tools the
        text goes through a ToolStream (finish "tool_calls" when the reply stopped after calls)."""
        ts = ToolStream() if self.calls else None
        finish = "stop"
        async for text, fin in self.events():
            thought, text = self.reasoned(text, fin is not None)
            if thought:
                yield Delta("reasoning", thought)
            if ts is None:
                if text:
                    yield Delta("content", text)
            else:
                for d in ts.feed(text) if text else []:
                    for x in delta_of(d):
                        yield x
            finish = fin or finish
        if ts is not None:
            for d in ts.finish():
                for x in delta_of(d):
                    yield x
        self.finish = "tool_calls" if ts is not None and finish == "stop" and ts.n_calls else finish
