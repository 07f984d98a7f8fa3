"""A request's tools: `tools` + `tool_choice` + `parallel_tool_calls` -> a ToolPlan (or a 400),
and the call format both prompt paths describe and the grammar enforces (the Hermes/Qwen2.5 one):
    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call>"""
from __future__ import annotations

import json
from dataclasses import dataclass

from edgekv.runtime.grammar_build import check_schema
from edgekv.runtime.grammar_engine import GrammarError
from edgekv.serve.api import bad_request
from edgekv.serve.structured import NAME

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # OpenAI's limit
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
CHOICES = ("none", "auto", "required")
# calls one reply may make where parallel calls are allowed: the list ends there (and earlier, at
# a call that repeats one made before it: tool_constraint.py), never an unbounded repeat
MAX_PARALLEL_CALLS = 8


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
        raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    f = t["function"]
    if not isinstance(f.get("name"), str) or not NAME.fullmatch(f["name"]):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, _ or -", "tools")
    if f.get("description") is not None and not isinstance(f["description"], str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    params = f.get("parameters")
    if params is None:
        params = EMPTY_PARAMETERS
    if not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON Schema object", "tools")
    if f.get("strict") is not None and not isinstance(f["strict"], bool):
        raise bad_request(f"{where}.function.strict must be true, false or null", "tools")
    try:
        check_schema(params, f"{where}.function.parameters")
    except GrammarError as e:
        raise bad_request(str(e), "tools") from None
    return Tool(f["name"], f.get("description") or "", params, t)


def tools_of(body: dict) -> ToolPlan | None:
    """The request's tools, tool_choice and parallel_tool_calls (None: no tools, no choice)."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be true, false or null", "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of up to {MAX_TOOLS} functions", "tools")
    tools = tuple(_tool_of(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("'tools' names a function twice", "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise bad_request(f"'tool_choice' must be one of {', '.join(CHOICES)} or a named function", "tool_choice")
        return ToolPlan(tools, choice, parallel is not False, tools)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if named not in names:
        raise bad_request('\'tool_choice\' must name one of the tools: {"type": "function", "function": {"name": ...}}',
                          "tool_choice")
    return ToolPlan(tuple(t for t in tools if t.name == named), "function", False, tools)


def call_text(name: str, arguments) -> str:
    """One call in the format the grammar enforces (and the generic prompt shows)."""
    return f'{OPEN}\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n{CLOSE}'
