"""tool_choice "required" and a named tool are forced by a grammar that admits no free
whitespace (as vLLM's), whatever the server's structured-output default: the grammar a request
compiles to accepts compact JSON only."""

from __future__ import annotations

import pytest

from pagedserve.entrypoints.openai.tool_calls import plan_tools

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                  "function": {"name": "get_weather"}}])
def test_forced_tool_calls_are_compact(choice):
    xgr = pytest.importorskip("xgrammar")
    plan = plan_tools(TOOLS, choice, None)
    constraint = plan.constraint
    assert constraint.disable_any_whitespace
    # the grammar itself: a byte-level matcher refuses a space where JSON would allow one
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    grammar = xgr.GrammarCompiler(info).compile_json_schema(
        constraint.schema_text(), any_whitespace=not constraint.disable_any_whitespace)
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string("[" if choice == "required" else "{")
    assert not matcher.accept_string(" ")
