"""Tool calling in chat completions: checking `tools` and `tool_choice`, the structured-output
constraint that enforces `required` and a named function, and turning the generated text into
OpenAI `tool_calls` (whole, or as stream deltas).

- ``none``: plain text (the template still receives the tools, as in vLLM).
- ``auto`` (the default when tools are given): the model's text is parsed with the server's
  `--tool-call-parser` (needs `--enable-auto-tool-choice`); calls found -> finish_reason
  "tool_calls".
- ``required``: the output is constrained to a JSON list of ``{"name", "parameters"}`` objects,
  one of the tools each with arguments matching its parameters schema (vLLM's schema);
  finish_reason "tool_calls".
- a named function: the output is constrained to that function's parameters schema and is the
  call's arguments; finish_reason stays "stop" (as OpenAI and vLLM do).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    random_id,
)
from pagedserve.entrypoints.openai.tool_parsers import ParsedCall, ToolParser
from pagedserve.structured_output import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How a chat request uses its tools."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # as the chat template receives them
    named: str | None = None
    constraint: StructuredOutputsParams | None = None
    parser: ToolParser | None = None

    @property
    def makes_calls(self) -> bool:
        return self.mode != "none"


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise APIError("tools must be a list of function tools", 400, "tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn, dict):
            raise APIError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}",
                           400, "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '-' "
                           f"or '.', got {name!r}", 400, "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(f"tools[{i}].function.parameters must be a JSON schema object", 400,
                           "tools")
        out.append({"type": "function", "function": dict(fn)})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        raise APIError("tools: function names must be unique", 400, "tools")
    return out


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or EMPTY_PARAMETERS


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    """The grammar of a forced call. NOTE: compact JSON (no free whitespace between tokens),
    whatever --structured-outputs-disable-any-whitespace says, as vLLM's tool-call grammar: with
    free whitespace a small model may write spaces until max_tokens and never close the call."""
    try:
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    except ValueError as e:
        raise APIError(str(e).replace("structured_outputs.json", "tools: a parameters schema"),
                       400, "tools") from None


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema for `tool_choice: "required"`: a non-empty list of calls (one call exactly
    when `parallel_tool_calls` is false)."""
    bound = {} if parallel else {"maxItems": 1}
    return {"type": "array", "minItems": 1, **bound, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": _parameters(t)},
         "required": ["name", "parameters"]} for t in tools]}}


def plan_tools(tools: Any, tool_choice: Any, parser: ToolParser | None,
               parallel: bool = True) -> ToolPlan | None:
    """The request's tool plan, or None without tools. 400 for what cannot be served."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError("tool_choice needs tools", 400, "tool_choice")
        return None
    tools = _check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto"
    if tool_choice == "none":
        return ToolPlan("none", tools)
    if tool_choice == "auto":
        if parser is None:
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set", 400, "tool_choice")
        return ToolPlan("auto", tools, parser=parser)
    if tool_choice == "required":
        return ToolPlan("required", tools, constraint=_constraint(required_schema(tools, parallel)))
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                       "'function': {'name': ...}}", 400, "tool_choice")
    match = [t for t in tools if t["function"]["name"] == name]
    if not match:
        raise APIError(f"tool_choice: function {name!r} is not in tools", 400, "tool_choice")
    return ToolPlan("named", tools, named=name, constraint=_constraint(_parameters(match[0])))


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedCall]]:
    """The content and the calls in a finished choice's text (no calls: the text is content)."""
    if plan.mode == "named":
        return None, [(plan.named, text)]
    if plan.mode == "required":
        try:
            calls = json.loads(text)
            return None, [(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                          for c in calls]
        except (ValueError, TypeError, KeyError):  # cut short by max_tokens
            return text, []
    if plan.mode == "auto":
        return plan.parser.parse(text, plan.tools)
    return text, []


def tool_calls_json(calls: list[ParsedCall]) -> list[ToolCall]:
    return [ToolCall(id=random_id("chatcmpl-tool"), function=FunctionCall(name=n, arguments=a))
            for n, a in calls]


def finish_reason(plan: ToolPlan | None, calls: list[ParsedCall], reason: str | None) -> str | None:
    """ "tool_calls" when an auto or required choice made calls; else the engine's reason."""
    if plan is not None and calls and plan.mode in ("auto", "required") and reason == "stop":
        return "tool_calls"
    return reason


@dataclass
class ToolStream:
    """One streamed choice's text turned into content and tool-call deltas. Content that cannot
    be part of a call is sent as it comes; a call's text is held until the choice ends, then
    sent as one delta per call (a named function streams its arguments as they come)."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # characters of `text` sent as content (auto) or arguments (named)
    calls: list[ParsedCall] = field(default_factory=list)

    def feed(self, delta: str, finished: bool) -> tuple[str, list[DeltaToolCall]]:
        """(content delta, tool-call deltas) for the next piece of text."""
        self.text += delta
        mode = self.plan.mode
        if mode == "named":
            first = self.sent == 0 and not self.calls
            if first:
                self.calls = [(self.plan.named, "")]
            self.sent = len(self.text)
            if not (first or delta):
                return "", []
            return "", [DeltaToolCall(
                index=0, id=random_id("chatcmpl-tool") if first else None,
                type="function" if first else None,
                function=DeltaFunctionCall(name=self.plan.named if first else None,
                                           arguments=delta))]
        if mode == "auto" and not finished:
            start = self.plan.parser.tool_start(self.text)
            end = len(self.text) if start is None else max(start, self.sent)
            if not self.text[:end].strip():
                return "", []  # blank so far: blank content next to calls is None (held)
            out, self.sent = self.text[self.sent:end], end
            return out, []
        if not finished:  # required: the calls are known at the end
            return "", []
        content, self.calls = parse_calls(self.plan, self.text)
        # NOTE: the content starts with the text sent so far (`base.ToolParser`'s rule).
        rest = (content or "")[self.sent:]
        self.sent = len(self.text)
        if not self.calls:
            return rest, []
        return rest, [DeltaToolCall(index=i, id=random_id("chatcmpl-tool"), type="function",
                                    function=DeltaFunctionCall(name=n, arguments=a))
                      for i, (n, a) in enumerate(self.calls)]
