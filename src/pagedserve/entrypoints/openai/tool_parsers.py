"""Parsing tool calls out of a model's text (`tool_choice: "auto"`), as vLLM's parsers of the same
names do:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen);
  the text before the first block is the content.
- ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}`` (optionally after
  ``<|python_tag|>``), several separated by ``;``.
- ``pythonic``: the whole output is a Python list of calls, ``[f(a=1), g(b="x")]``; arguments are
  read with `ast.literal_eval` (literals only, nothing is executed).

Each parser returns the content (or None) and the calls as (name, arguments JSON text); text that
does not parse as calls is plain content.
"""

from __future__ import annotations

import ast
import json
import re

ParsedCall = tuple[str, str]  # (function name, arguments as JSON text)


class ToolParser:
    """Base: `parse` the final text; `tool_start` says where a tool call may begin (streaming
    sends the text before it as content and holds the rest until the end)."""

    name = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def tool_start(self, text: str) -> int | None:
        """The index in `text` from which a tool call has begun or may still begin (a prefix of
        the marker at the end), or None when none can."""
        raise NotImplementedError


def _prefix_at_end(text: str, marker: str) -> int | None:
    for k in range(min(len(marker), len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return None


def _arguments(value) -> str | None:
    if value is None:
        value = {}
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _call_of(obj, args_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = _arguments(obj.get(args_key, obj.get("arguments")))
    return None if args is None else (obj["name"], args)


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text):
        if self.START not in text:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                call = _call_of(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[: text.index(self.START)]
        return (content if content.strip() else None), calls

    def tool_start(self, text):
        i = text.find(self.START)
        return i if i >= 0 else _prefix_at_end(text, self.START)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text):
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        try:
            while i < len(body):
                obj, i = decoder.raw_decode(body, i)
                call = _call_of(obj, "parameters")
                if call is None:
                    return text, []
                calls.append(call)
                rest = body[i:].lstrip()
                if rest.startswith(";"):
                    rest = rest[1:].lstrip()
                elif rest:
                    return text, []
                i = len(body) - len(rest)
        except ValueError:
            return text, []
        return None, calls

    def tool_start(self, text):
        stripped = text.lstrip()
        if not stripped:
            return 0 if text else None
        if stripped.startswith("{") or self.TAG.startswith(stripped[: len(self.TAG)]):
            return 0
        return None


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text):
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name)
                    or node.args):
                return text, []
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return text, []
            if None in args:  # **kwargs
                return text, []
            calls.append((node.func.id, json.dumps(args, ensure_ascii=False)))
        return None, calls

    def tool_start(self, text):
        stripped = text.lstrip()
        if not stripped:
            return 0 if text else None
        return 0 if stripped.startswith("[") else None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)
}


def make_tool_parser(name: str) -> ToolParser:
    """The parser named `name` (ValueError listing the known ones)."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {name!r}")
    return cls()
