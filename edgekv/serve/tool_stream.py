"""A tool-calling reply's text -> OpenAI's message: `ToolStream` turns it, piece by piece as it
streams, into `delta.content` / `delta.tool_calls` pieces whose concatenation is `parse_reply`'s
message exactly. A call that repeats an earlier one of the same reply (name and arguments, as
written) is dropped: its deltas are held while it may still be one (tool_constraint.py ends the
reply there)."""
from __future__ import annotations

import json
import re
import uuid
from typing import Callable

from edgekv.serve.tool_plan import CLOSE, OPEN

def new_call_id(index: int) -> str:
    return "call_" + uuid.uuid4().hex[:24]


# a call's head after the opening marker, exactly as the grammar writes it
HEAD_START, HEAD_END = '\n{"name": "', '", "arguments": '
HEAD = re.compile(re.escape(HEAD_START) + r"([a-zA-Z0-9_-]{1,64})" + re.escape(HEAD_END))


class ToolStream:
    """Turns a reply's text, piece by piece as it streams, into OpenAI deltas: {"content": ...}
    for text, {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}
    when a call's name is known, then {"tool_calls": [{"index", "function": {"arguments": piece}}]}
    as its arguments arrive. Text that may still be the start of the marker is held back, and so
    is whitespace just before it (it separates text from the call). A call whose head is not
    the grammar's is passed on as text. A call that repeats an earlier one is not passed on: its
    deltas wait while its name and arguments so far begin an earlier call's (`repeats` counts
    the ones dropped)."""

    def __init__(self, make_id: Callable[[int], str] = new_call_id):
        self.make_id = make_id
        self.buf = ""  # text not yet turned into deltas
        self.state = "text"  # text | head | args | tail
        self.n_calls = 0
        self.complete = 0  # calls whose closing marker came
        self._ws = ""  # the whitespace before the last marker
        self._depth, self._in_str, self._esc = 0, False, False  # the arguments' JSON scan
        self.seen: list[str] = []  # each call passed on: its name, NUL, its arguments as written
        self.repeats = 0  # calls dropped as repeats
        self._call = ""  # the call under way, as `seen` holds them
        self._waiting: list[dict] | None = None  # its deltas, held while it may be a repeat
        self._repeat = False  # the call under way repeated one: its closing is not counted

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while True:
            step = getattr(self, f"_{self.state}")(out, final=False)
            if not step:
                return out

    def finish(self) -> list[dict]:
        """The deltas of what is left (a reply cut short ends inside a call: its arguments are
        passed on as far as they came)."""
        out: list[dict] = []
        while getattr(self, f"_{self.state}")(out, final=True):  # a cut head becomes text
            pass
        if self.state == "args" and self.buf:
            self._pass(out, self._args_delta(self.buf), self.buf)
        if self._waiting is not None:  # cut while it could still have been a repeat: it is shown as far as it came
            out.extend(self._waiting)
            self._waiting = None
        self.buf = ""  # what is left after a call's arguments is its closing (not shown)
        return out

    # each state's step: True if it consumed something and another step may follow
    def _text(self, out: list[dict], final: bool) -> bool:
        at = self.buf.find(OPEN)
        if at < 0:
            end = len(self.buf)
            if not final:  # a possible start of the marker waits, and the whitespace before it
                end = len(self.buf[: end - _held(self.buf, OPEN)].rstrip())
            if end:
                out.append({"content": self.buf[:end]})
                self.buf = self.buf[end:]
            return False
        before = self.buf[:at].rstrip()
        if before:
            out.append({"content": before})
        self._ws = self.buf[len(before):at]  # given back if the marker turns out to be no call
        self.buf = self.buf[at + len(OPEN):]
        self.state = "head"
        return True

    def _head(self, out: list[dict], final: bool) -> bool:
        m = HEAD.match(self.buf)
        if m is None:
            if not final and _head_prefix(self.buf):
                return False  # wait for more
            # not the grammar's call: the marker is text, and what follows it
            out.append({"content": self._ws + OPEN})
            self.state = "text"
            return True
        index = self.n_calls
        self.n_calls += 1
        self._call, self._waiting, self._repeat = m.group(1) + "\0", [], False
        self._pass(out, {"tool_calls": [{"index": index, "id": self.make_id(index), "type": "function",
                                         "function": {"name": m.group(1), "arguments": ""}}]}, "")
        self.buf = self.buf[m.end():]
        self.state, self._depth, self._in_str, self._esc = "args", 0, False, False
        return True

    def _args(self, out: list[dict], final: bool) -> bool:
        end = self._scan()
        if end is None:  # the arguments go on: pass on what came
            if self.buf:
                self._pass(out, self._args_delta(self.buf), self.buf)
                self.buf = ""
            return False
        if end:
            self._pass(out, self._args_delta(self.buf[:end]), self.buf[:end])
        if self._waiting is not None and self._call in self.seen:  # a repeat: dropped, its index free again
            self._waiting, self._repeat = None, True
            self.n_calls -= 1
            self.repeats += 1
        else:
            if self._waiting:
                out.extend(self._waiting)
            self._waiting = None
            self.seen.append(self._call)
        self.buf, self.state = self.buf[end:], "tail"
        return True

    def _pass(self, out: list[dict], delta: dict, text: str) -> None:
        """A delta of the call under way: passed on, or held while the call may repeat an earlier one."""
        self._call += text
        if self._waiting is None:
            out.append(delta)
            return
        self._waiting.append(delta)
        if not any(c.startswith(self._call) for c in self.seen):  # a new call: what was held goes out
            out.extend(self._waiting)
            self._waiting = None

    def _tail(self, out: list[dict], final: bool) -> bool:
        at = self.buf.find(CLOSE)
        if at < 0:
            return False  # the closing `}` and marker are not shown
        self.complete += not self._repeat
        self.buf, self.state = self.buf[at + len(CLOSE):], "between"
        return True

    def _between(self, out: list[dict], final: bool) -> bool:
        stripped = self.buf.lstrip()
        if stripped.startswith(OPEN):
            self._ws = self.buf[: len(self.buf) - len(stripped)]
            self.buf, self.state = stripped[len(OPEN):], "head"
            return True
        if not final and (not stripped or OPEN.startswith(stripped)):
            return False
        self.state = "text"  # text after the calls (not the grammar's): content
        self.buf = stripped if stripped else ""
        return bool(self.buf)

    def _scan(self) -> int | None:
        """The end (in buf) of the arguments' JSON value, None while it goes on."""
        for i, ch in enumerate(self.buf):
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None

    def _args_delta(self, piece: str) -> dict:
        return {"tool_calls": [{"index": self.n_calls - 1, "function": {"arguments": piece}}]}


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _head_prefix(text: str) -> bool:
    """`text` may still grow into a call's head."""
    if len(text) <= len(HEAD_START):
        return HEAD_START.startswith(text)
    if not text.startswith(HEAD_START):
        return False
    name = re.match(r"[a-zA-Z0-9_-]{0,64}", text[len(HEAD_START):])
    return HEAD_END.startswith(text[len(HEAD_START) + name.end():])


def assemble(deltas: list[dict]) -> dict:
    """Deltas folded into one message: {"role", "content" (None if no text), "tool_calls"?}."""
    content, calls = [], []
    for d in deltas:
        if "content" in d:
            content.append(d["content"])
        for c in d.get("tool_calls", []):
            if c["index"] == len(calls):
                calls.append({"id": c["id"], "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": ""}})
            calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
    msg = {"role": "assistant", "content": "".join(content) or None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def parse_reply(text: str, make_id: Callable[[int], str] = new_call_id) -> tuple[dict, int]:
    """A finished reply -> (the OpenAI message, how many calls are complete)."""
    ts = ToolStream(make_id)
    msg = assemble(ts.feed(text) + ts.finish())
    return msg, ts.complete


def finish_reason(engine_reason: str, msg: dict) -> str:
    """OpenAI's finish_reason: "tool_calls" for a reply that stopped after its calls."""
    return "tool_calls" if engine_reason == "stop" and msg.get("tool_calls") else engine_reason


class ToolCallError(ValueError):
    """A reply's tool call whose arguments are not JSON (a reply cut short, or one made without the
    grammar): a fault of what the model wrote, never of the request, so never an HTTP 400 (the
    server passes a cut call on as written, with finish_reason length)."""


def check_arguments(msg: dict) -> None:
    """Every call's arguments parse as JSON (the grammar makes them; a cut reply may not):
    ToolCallError where one does not."""
    for c in msg.get("tool_calls", []):
        try:
            json.loads(c["function"]["arguments"])
        except ValueError:
            raise ToolCallError(f"tool call {c['function']['name']}: its arguments are not whole JSON") from None
