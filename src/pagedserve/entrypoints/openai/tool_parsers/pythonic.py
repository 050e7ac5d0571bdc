"""``pythonic`` (Llama 3.2, ToolACE): the whole output is a Python list of calls,
``[f(a=1), g(b="x")]``. Arguments are read with `ast.literal_eval`: literals only, nothing is
executed."""

from __future__ import annotations

import ast
import json

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    ToolParser,
    leading_start,
)


def pythonic_calls(body: str) -> list[ParsedCall] | None:
    """The calls of a Python list of keyword-argument calls with literal values, or None."""
    body = body.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        name = node.func.id
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        if None in args:  # **kwargs
            return None
        try:
            calls.append((name, json.dumps(args, ensure_ascii=False)))
        except (TypeError, ValueError):  # a set, bytes, complex: not JSON
            return None
    return calls


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text, tools=None):
        calls = pythonic_calls(text)
        return (text, []) if calls is None else (None, calls)

    def tool_start(self, text):
        return leading_start(text, ("[",))
