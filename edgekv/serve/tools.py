"""Tool calling for the OpenAI chat API (docs/structured.md): the request's tools (tool_plan.py),
the prompt (the bundle's chat template with `tools` when it takes them, else the generic format:
the tools described in a system message, here), the grammar and constraint (tool_grammar.py,
tool_constraint.py), the reply -> `message.tool_calls` or streamed `delta.tool_calls`
(tool_stream.py). The front ends import each name from its own module. The call format is the
Hermes/Qwen2.5 one:
    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>
Under tool_choice required or auto a reply is one list of calls (several where parallel_tool_calls
allows, at most MAX_PARALLEL_CALLS, ended at a repeat) and then ends: finish_reason tool_calls.
Pure functions: the HTTP layer calls them (nothing here holds a request's state but ToolStream)."""
from __future__ import annotations

import json
import re

from edgekv.runtime.text import render_bounded
from edgekv.serve.api import bad_request
from edgekv.serve.tool_plan import CLOSE, OPEN, ToolPlan, call_text


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
        raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
    try:
        c.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"messages[{i}].content holds a lone surrogate (not valid Unicode text)",
                          "messages") from None
    return c


def _calls_of(m: dict, i: int) -> list[dict]:
    """An assistant message's tool_calls as [{"id", "name", "arguments": dict}]."""
    calls = m.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(c.get("id"), str) and isinstance(f, dict) and isinstance(f.get("name"), str)
                and isinstance(f.get("arguments"), str)):
            raise bad_request(f"messages[{i}].tool_calls[{j}] must have an id, a function name and arguments "
                              "(a JSON string)", "messages")
        try:
            args = json.loads(f["arguments"])
        except ValueError:
            raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON", "messages") from None
        out.append({"id": c["id"], "name": f["name"], "arguments": args})
    return out


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def chat_messages(msgs) -> list[dict]:
    """OpenAI messages -> checked ones: {"role", "content"} plus, for an assistant's calls,
    "tool_calls" [{"id", "name", "arguments": dict}], and for a tool's result "tool_call_id"
    (the id of a call made before it) and the called function's "name"."""
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out, called = [], {}  # call id -> function name
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad_request(f"messages[{i}] must be an object with a role of {sorted(ROLES)}", "messages")
        role = ROLES[m["role"]]
        calls = _calls_of(m, i) if role == "assistant" else []
        msg = {"role": role, "content": _content(m, i, nullable=bool(calls))}
        if calls:
            msg["tool_calls"] = calls
            called.update((c["id"], c["name"]) for c in calls)
        if role == "tool":
            cid = m.get("tool_call_id")
            if cid not in called:
                raise bad_request(f"messages[{i}]: a tool message must answer a tool call made before it "
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
