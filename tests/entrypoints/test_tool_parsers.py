"""The tool-call parsers (hermes, llama3_json, pythonic; every format is in
test_tool_parser_formats.py), the tool plans, and the streaming split of content and calls,
without a server."""

import json

import pytest

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.tool_calls import (
    ToolStream,
    parse_calls,
    plan_tools,
    required_schema,
)
from pagedserve.entrypoints.openai.tool_parsers import make_tool_parser

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "g"}}]


def test_hermes_reads_blocks_and_keeps_the_text_before_them_as_content():
    p = make_tool_parser("hermes")
    text = ('Let me check. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    content, calls = p.parse(text)
    assert content == "Let me check. "
    assert calls == [("f", '{"x": 1}'), ("g", "{}")]
    assert p.parse("no calls here") == ("no calls here", [])
    bad = '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
    assert p.parse(bad) == (bad, [])


def test_llama3_json_reads_one_or_several_calls_and_leaves_other_text():
    p = make_tool_parser("llama3_json")
    assert p.parse('{"name": "f", "parameters": {"x": 2}}') == (None, [("f", '{"x": 2}')])
    assert p.parse('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", '
                   '"parameters": {"a": "b"}}')[1] == [("f", "{}"), ("g", '{"a": "b"}')]
    assert p.parse('{"answer": 3}') == ('{"answer": 3}', [])
    assert p.parse("plain") == ("plain", [])


def test_pythonic_reads_literal_keyword_arguments_and_executes_nothing():
    p = make_tool_parser("pythonic")
    assert p.parse('[f(x=1, y="a"), g()]') == (None, [("f", '{"x": 1, "y": "a"}'), ("g", "{}")])
    for text in ("[f(__import__('os').getcwd())]", "[f(x=open('/etc/passwd'))]", "[f(1)]",
                 "not a list", "[]"):
        assert p.parse(text) == (text, [])


def test_unknown_parser_names_are_refused():
    with pytest.raises(ValueError, match="tool_call_parser must be one of .*hermes"):
        make_tool_parser("no_such_parser")


def test_plans_enforce_required_and_named_choices_with_a_schema():
    assert plan_tools(None, None, None) is None
    assert plan_tools(TOOLS, "none", None).mode == "none"
    with pytest.raises(APIError, match="requires --enable-auto-tool-choice"):
        plan_tools(TOOLS, None, None)  # auto is the default with tools
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "g"}}, None)
    assert named.mode == "named" and json.loads(named.constraint.schema_text())["type"] == "object"
    req = plan_tools(TOOLS, "required", None)
    assert json.loads(req.constraint.schema_text()) == required_schema(req.tools)
    assert parse_calls(req, '[{"name": "g", "parameters": {}}]') == (None, [("g", "{}")])
    assert parse_calls(req, '[{"name": "g", "par') == ('[{"name": "g", "par', [])


def test_auto_stream_sends_content_before_a_call_and_holds_a_possible_marker():
    plan = plan_tools(TOOLS, "auto", make_tool_parser("hermes"))
    s = ToolStream(plan)
    out = [s.feed(piece, False) for piece in ("Hi ", "there <to", "ol_call>", '{"name": "g", ',
                                              '"arguments": {}}</tool_call>')]
    assert [c for c, _ in out] == ["Hi ", "there ", "", "", ""]
    content, deltas = s.feed("", True)
    assert content == "" and [(d.index, d.function.name) for d in deltas] == [(0, "g")]
    s = ToolStream(plan)
    assert s.feed("a <tox", False) == ("a <tox", [])  # not a marker after all
    assert s.feed("", True) == ("", [])


def test_named_stream_sends_the_name_first_then_argument_pieces():
    s = ToolStream(plan_tools(TOOLS, {"type": "function", "function": {"name": "f"}}, None))
    _, [first] = s.feed('{"x"', False)
    _, [second] = s.feed(": 1}", True)
    assert first.id and first.function.name == "f" and first.function.arguments == '{"x"'
    assert second.id is None and second.function.name is None
    assert second.function.arguments == ": 1}"
