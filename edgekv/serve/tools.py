"""Tool calling for the OpenAI chat API (docs/structured.md): `tools` + `tool_choice` +
`parallel_tool_calls` -> a ToolPlan; the prompt (the bundle's chat template with `tools` when it
takes them, else the generic format: the tools described in a system message); the grammar the
reply follows (lazy for "auto": free text until the call's opening marker; forced for
"required" or a named function); a finished reply -> `message.tool_calls`; a streamed one ->
`delta.tool_calls` pieces whose concatenation is the non-streamed reply.

The call format is the Hermes/Qwen2.5 one, in both paths:
    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>
Pure functions: the HTTP layer calls them (nothing here holds a request's state but ToolStream)."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable

from edgekv.errors import EdgeKVError
from edgekv.runtime import grammar as g
from edgekv.runtime.text import render_bounded
from edgekv.serve.structured import NAME, BadRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # OpenAI's limit
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON Schema for the arguments object
    spec: dict  # the tool as the client sent it (what a template renders)


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" | "function" (one named function: `tools` is that one)
    parallel: bool
    offered: tuple[Tool, ...]  # every tool of the request (the prompt describes them all)

    @property
    def calls_possible(self) -> bool:
        return self.choice != "none"


def _tool_of(t, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise BadRequest(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    f = t["function"]
    if not isinstance(f.get("name"), str) or not NAME.fullmatch(f["name"]):
        raise BadRequest(f"{where}.function.name must be 1-64 letters, digits, _ or -", "tools")
    if f.get("description") is not None and not isinstance(f["description"], str):
        raise BadRequest(f"{where}.function.description must be a string", "tools")
    params = f.get("parameters")
    if params is None:
        params = EMPTY_PARAMETERS
    if not isinstance(params, dict):
        raise BadRequest(f"{where}.function.parameters must be a JSON Schema object", "tools")
    if f.get("strict") is not None and not isinstance(f["strict"], bool):
        raise BadRequest(f"{where}.function.strict must be true, false or null", "tools")
    try:
        g.check_schema(params, f"{where}.function.parameters")
    except g.GrammarError as e:
        raise BadRequest(str(e), "tools") from None
    return Tool(f["name"], f.get("description") or "", params, t)


def tools_of(body: dict) -> ToolPlan | None:
    """The request's tools, tool_choice and parallel_tool_calls (None: no tools, no choice)."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be true, false or null", "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise BadRequest("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of up to {MAX_TOOLS} functions", "tools")
    tools = tuple(_tool_of(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise BadRequest("'tools' names a function twice", "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise BadRequest(f"'tool_choice' must be one of {', '.join(CHOICES)} or a named function", "tool_choice")
        return ToolPlan(tools, choice, parallel is not False, tools)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if named not in names:
        raise BadRequest('\'tool_choice\' must name one of the tools: {"type": "function", "function": {"name": ...}}',
                         "tool_choice")
    return ToolPlan(tuple(t for t in tools if t.name == named), "function", False, tools)


# -- the prompt ----------------------------------------------------------------------------------

def template_takes_tools(chat_template: str | None) -> bool:
    """The template renders `tools` itself (Qwen2.5, Llama 3.1+, Hermes-style templates do)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def generic_tools_prompt(plan: ToolPlan) -> str:
    """The system-message text that describes the tools to a model whose template has no tool
    support (docs/structured.md: the generic format)."""
    lines = ["You can call functions (tools). Their signatures, as JSON, are within <tools></tools>:", "<tools>"]
    lines += [json.dumps(t.spec, ensure_ascii=False) for t in plan.offered]
    lines += ["</tools>", "To call a function, answer with a JSON object with its name and arguments within "
              "<tool_call></tool_call> tags:", OPEN, '{"name": <function-name>, "arguments": <arguments-json-object>}',
              CLOSE]
    if plan.choice == "required":
        lines.append("Answer with a function call.")
    elif plan.choice == "function":
        lines.append(f"Answer with a call of the function {plan.tools[0].name}.")
    elif plan.choice == "none":
        lines.append("Do not call a function now: answer in text.")
    return "\n".join(lines)


def _content(m: dict, i: int, nullable: bool) -> str:
    c = m.get("content")
    if c is None and nullable:
        return ""
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        c = "".join(p["text"] for p in c)
    if not isinstance(c, str):
        raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", "messages")
    try:
        c.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"messages[{i}].content holds a lone surrogate (not valid Unicode text)", "messages") from None
    return c


def _calls_of(m: dict, i: int) -> list[dict]:
    """An assistant message's tool_calls as [{"id", "name", "arguments": dict}]."""
    calls = m.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise BadRequest(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(c.get("id"), str) and isinstance(f, dict) and isinstance(f.get("name"), str)
                and isinstance(f.get("arguments"), str)):
            raise BadRequest(f"messages[{i}].tool_calls[{j}] must have an id, a function name and arguments "
                             "(a JSON string)", "messages")
        try:
            args = json.loads(f["arguments"])
        except ValueError:
            raise BadRequest(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON", "messages") from None
        out.append({"id": c["id"], "name": f["name"], "arguments": args})
    return out


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def chat_messages(msgs) -> list[dict]:
    """OpenAI messages -> checked ones: {"role", "content"} plus, for an assistant's calls,
    "tool_calls" [{"id", "name", "arguments": dict}], and for a tool's result "tool_call_id"
    (the id of a call made before it) and the called function's "name"."""
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out, called = [], {}  # call id -> function name
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] must be an object with a role of {sorted(ROLES)}", "messages")
        role = ROLES[m["role"]]
        calls = _calls_of(m, i) if role == "assistant" else []
        msg = {"role": role, "content": _content(m, i, nullable=bool(calls))}
        if calls:
            msg["tool_calls"] = calls
            called.update((c["id"], c["name"]) for c in calls)
        if role == "tool":
            cid = m.get("tool_call_id")
            if cid not in called:
                raise BadRequest(f"messages[{i}]: a tool message must answer a tool call made before it "
                                 "(its tool_call_id)", "messages")
            msg["tool_call_id"], msg["name"] = cid, called[cid]
        out.append(msg)
    return out


def template_messages(msgs: list[dict]) -> list[dict]:
    """Checked messages as Hugging Face tool templates take them: tool_calls as
    [{"id", "type": "function", "function": {"name", "arguments": dict}}], tool results as role
    "tool" with tool_call_id and name."""
    out = []
    for m in msgs:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
        out.append(m)
    return out


def call_text(name: str, arguments) -> str:
    """One call in the format the grammar enforces (and the generic prompt shows)."""
    return f'{OPEN}\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n{CLOSE}'


def generic_messages(msgs: list[dict], plan: ToolPlan | None) -> list[dict]:
    """Checked messages for a template without tool support: the tools in the system message, an
    assistant's calls as their text, tool results as a user message of <tool_response> blocks
    (consecutive results in one: templates that want user and assistant turns in turn accept it)."""
    out: list[dict] = []
    if plan is not None:
        if msgs[0]["role"] == "system":
            out.append({"role": "system", "content": msgs[0]["content"] + "\n\n" + generic_tools_prompt(plan)})
            msgs = msgs[1:]
        else:
            out.append({"role": "system", "content": generic_tools_prompt(plan)})
    for m in msgs:
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = "\n".join(call_text(c["name"], c["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def render_prompt(codec, msgs: list[dict], plan: ToolPlan | None, takes_tools: bool) -> str:
    """The prompt text for checked messages: through the template with `tools` when it takes
    them (`takes_tools`: template_takes_tools of the bundle's template, found once), else the
    generic format. TextCodec.render passes no `tools`: the template is rendered here with
    text.render_bounded, the same bounded sandbox and context."""
    if codec.template is not None and takes_tools:
        ctx = {"messages": template_messages(msgs), "add_generation_prompt": True,
               "bos_token": codec.special.get("bos_token") or "", "eos_token": codec.special.get("eos_token") or ""}
        if plan is not None:
            ctx["tools"] = [t.spec for t in plan.offered]
        if getattr(codec, "enable_thinking", None) is not None:  # as TextCodec.render passes it
            ctx["enable_thinking"] = bool(codec.enable_thinking)
        return render_bounded(codec.template, **ctx)
    return codec.render(generic_messages(msgs, plan))


# -- the grammar -----------------------------------------------------------------------------------

def _literal(tok: g.GrammarTokenizer | None, text: str) -> str:
    """The Lark for a marker: <text> where the tokenizer has it as one special token (a string
    literal could not match it), else a string literal."""
    if tok is not None:
        ids = tok.ll.tokenize_str(text, parse_special=True)
        if len(ids) == 1 and tok.ll.is_special_token(ids[0]):
            return text
    return json.dumps(text)


def tool_grammar(plan: ToolPlan, tok: g.GrammarTokenizer | None = None) -> g.Grammar | None:
    """The Lark grammar of a reply under `plan` (None for "none": the reply is free text).
    auto: any text without the opening marker, or text up to it (a lazy lexeme: the grammar is
    inert until the marker appears) and then calls; required / a named function: calls only.
    Each call: the marker, {"name": one of the tools, "arguments": that tool's schema}, the
    closing marker; several, separated by a newline, when parallel calls are allowed."""
    if not plan.calls_possible:
        return None
    op, cl = _literal(tok, OPEN), _literal(tok, CLOSE)
    rules = ["%llguidance {}"]
    if plan.choice == "auto":
        if op.startswith('"'):
            rules += ["start: TEXT | head calls", f"head[lazy]: TEXT {op}"]
        else:  # a special token ends free text by itself
            rules += [f"start: TEXT | TEXT {op} calls"]
        rules.append(r"TEXT: /(.|\n)*/")
    else:
        rules.append(f"start: {op} calls")
    rules.append(f'calls: call ("\\n" {op} call)*' if plan.parallel else "calls: call")
    alts = " | ".join(f"fn_{i}" for i in range(len(plan.tools)))
    rules.append(f'call: "\\n{{\\"name\\": \\"" ({alts}) "}}\\n" {cl}')
    for i, t in enumerate(plan.tools):  # names are [a-zA-Z0-9_-]: nothing to escape
        rules.append(f'fn_{i}: "{t.name}\\", \\"arguments\\": " args_{i}')
        try:
            rules.append(f"args_{i}: {g.lark_json(t.parameters, f'the parameters of {t.name}')}")
        except g.GrammarError as e:
            raise BadRequest(str(e), "tools") from None
    patterns = tuple(dict.fromkeys(p for t in plan.tools for p in g.counted_patterns(t.parameters)))
    try:
        return g.lark("\n".join(rules), patterns)  # each pattern also tried alone by compile_grammar
    except g.GrammarError as e:
        raise BadRequest(f"tools: {e}", "tools") from None


# -- the reply -------------------------------------------------------------------------------------

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
    the grammar's is passed on as text."""

    def __init__(self, make_id: Callable[[int], str] = new_call_id):
        self.make_id = make_id
        self.buf = ""  # text not yet turned into deltas
        self.state = "text"  # text | head | args | tail
        self.n_calls = 0
        self.complete = 0  # calls whose closing marker came
        self._ws = ""  # the whitespace before the last marker
        self._depth, self._in_str, self._esc = 0, False, False  # the arguments' JSON scan

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
            out.append(self._args_delta(self.buf))
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
        out.append({"tool_calls": [{"index": index, "id": self.make_id(index), "type": "function",
                                    "function": {"name": m.group(1), "arguments": ""}}]})
        self.buf = self.buf[m.end():]
        self.state, self._depth, self._in_str, self._esc = "args", 0, False, False
        return True

    def _args(self, out: list[dict], final: bool) -> bool:
        end = self._scan()
        if end is None:  # the arguments go on: pass on what came
            if self.buf:
                out.append(self._args_delta(self.buf))
                self.buf = ""
            return False
        if end:
            out.append(self._args_delta(self.buf[:end]))
        self.buf, self.state = self.buf[end:], "tail"
        return True

    def _tail(self, out: list[dict], final: bool) -> bool:
        at = self.buf.find(CLOSE)
        if at < 0:
            return False  # the closing `}` and marker are not shown
        self.complete += 1
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


class ToolCallError(EdgeKVError):
    """A tool call whose arguments are not JSON (a reply cut short, or one made without the grammar)."""


def check_arguments(msg: dict) -> None:
    """Every call's arguments parse as JSON (the grammar makes them; a cut reply may not)."""
    for c in msg.get("tool_calls", []):
        try:
            json.loads(c["function"]["arguments"])
        except ValueError:
            raise ToolCallError(f"tool call {c['function']['name']}: its arguments are not whole JSON") from None


def request_constraint(body: dict, tok: g.GrammarTokenizer):
    """A chat request's constraint (None: free) and ToolPlan (None: no tools), from its
    response_format, tools, tool_choice and parallel_tool_calls; BadRequest for what cannot be
    served (response_format with callable tools is not combined yet)."""
    from edgekv.serve.structured import compile_for_request, response_format_grammar

    plan = tools_of(body)
    rf = response_format_grammar(body.get("response_format"))
    if rf is not None and plan is not None and plan.calls_possible:
        raise BadRequest("'response_format' together with callable 'tools' is not supported yet "
                         "(tool_choice none, or one of the two)", "response_format", code="unsupported_parameter")
    if plan is not None and plan.calls_possible:
        return compile_for_request(tok, tool_grammar(plan, tok), "tools"), plan
    return compile_for_request(tok, rf, "response_format"), plan
