"""Every tool-call parser (`--tool-call-parser`, vLLM's names) on model text shaped like vLLM's
own parser tests: calls with content before (and for some formats between or after) them, several
calls, typed XML-style parameters, text that is not a call. Each case is read whole and streamed
through `ToolStream` token by token (markers as single tokens, the rest in word-sized pieces) and
in irregular chunks: the streamed content always adds up to the whole text's content, and the
calls are the same."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve.entrypoints.openai.tool_calls import ToolStream, plan_tools
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, make_tool_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "set_flags", "parameters": {
        "type": "object", "properties": {
            "on": {"type": "boolean"}, "tags": {"type": "array"}, "opts": {"type": "object"},
            "note": {"type": ["string", "null"]}}}}},
]
W = ("get_weather", {"city": "Tokyo", "days": 3})
ADD = ("add", {"a": 1.5, "b": 2})
NONE = ("get_weather", {})

# parser -> [(model text, content, [(name, arguments)])]
CASES: dict[str, list[tuple[str, str | None, list]]] = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}\n'
         '</tool_call>', None, [W]),
        ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Tokyo", '
         '"days": 3}}</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1.5, "b": 2}}'
         '</tool_call>', "Let me check. ", [W, ADD]),
        ('<tool_call>{"name": "add", "arguments": {"a": 1.5, "b": 2}}', None, [ADD]),  # cut
        ("Hello! <tool_cal is not a tag", "Hello! <tool_cal is not a tag", []),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
         '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Tokyo", "days": 3}}', None, [W]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Tokyo", "days": 3}}; '
         '{"name": "add", "parameters": {"a": 1.5, "b": 2}}', None, [W, ADD]),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("The weather is fine.", "The weather is fine.", []),
    ],
    "pythonic": [
        ('[get_weather(city="Tokyo", days=3)]', None, [W]),
        ("[get_weather(city='Tokyo', days=3), add(a=1.5, b=2)]", None, [W, ADD]),
        ("[set_flags(on=True, tags=['x', 1], opts={'k': None}, note=None)]", None,
         [("set_flags", {"on": True, "tags": ["x", 1], "opts": {"k": None}, "note": None})]),
        ("[get_weather(city=__import__('os').getcwd())]",
         "[get_weather(city=__import__('os').getcwd())]", []),
        ("No calls here.", "No calls here.", []),
    ],
    "llama4_pythonic": [
        ('<|python_start|>[get_weather(city="Tokyo", days=3)]<|python_end|>', None, [W]),
        ('[get_weather(city="Tokyo", days=3), add(a=1.5, b=2)]', None, [W, ADD]),
        ("Plain answer.", "Plain answer.", []),
    ],
    "olmo3": [
        ('<function_calls>get_weather(city="Tokyo", days=3)\nadd(a=1.5, b=2)</function_calls>',
         None, [W, ADD]),
        ("Sure. <function_calls>\nget_weather(city='Tokyo', days=3)\n</function_calls>",
         "Sure. ", [W]),
    ],
    "lfm2": [
        ('<|tool_call_start|>[get_weather(city="Tokyo", days=3)]<|tool_call_end|>Checking.',
         "Checking.", [W]),
        ("Hi <|tool_call_start|>[add(a=1.5, b=2)]<|tool_call_end|>", "Hi ", [ADD]),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}, '
         '{"name": "add", "arguments": {"a": 1.5, "b": 2}}]', None, [W, ADD]),
        ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Tokyo", "days": 3}[TOOL_CALLS]add[ARGS]'
         '{"a": 1.5, "b": 2}', "Sure.", [W, ADD]),
        ('[TOOL_CALLS]get_weather{"city": "Tokyo", "days": 3}', None, [W]),
        ("A [TOOL_CALL] is not the marker.", "A [TOOL_CALL] is not the marker.", []),
    ],
    "deepseek_v3": [
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "Tokyo", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
         '<｜tool▁sep｜>add\n```json\n{"a": 1.5, "b": 2}\n```<｜tool▁call▁end｜>'
         "<｜tool▁calls▁end｜>", None, [W, ADD]),
        ("Checking the weather.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
         'get_weather\n```json\n{"city": "Tokyo", "days": 3}\n```<｜tool▁call▁end｜>'
         "<｜tool▁calls▁end｜>", "Checking the weather.", [W]),
    ],
    "deepseek_v31": [
        ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Tokyo", '
         '"days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1.5, "b": 2}'
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, [W, ADD]),
        ("Let me see.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
         '{"city": "Tokyo", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Let me see.", [W]),
    ],
    "kimi_k2": [
        ("I'll check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
         '<|tool_call_argument_begin|>{"city": "Tokyo", "days": 3}<|tool_call_end|>'
         "<|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>"
         '{"a": 1.5, "b": 2}<|tool_call_end|><|tool_calls_section_end|>', "I'll check.",
         [W, ADD]),
    ],
    "qwen3_coder": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", None, [W]),
        ("Sure, checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n"
         "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=add>\n<parameter=a>\n1.5\n</parameter>\n<parameter=b>\n2\n"
         "</parameter>\n</function>\n</tool_call>", "Sure, checking.\n", [W, ADD]),
        ("<tool_call>\n<function=set_flags>\n<parameter=on>\ntrue\n</parameter>\n"
         "<parameter=tags>\n[\"a\", 2]\n</parameter>\n<parameter=opts>\n{\"x\": 1}\n</parameter>"
         "\n<parameter=note>\nnull\n</parameter>\n</function>\n</tool_call>", None,
         [("set_flags", {"on": True, "tags": ["a", 2], "opts": {"x": 1}, "note": None})]),
        ("<tool_call>\n<function=unknown_fn>\n<parameter=n>\n5\n</parameter>\n</function>\n"
         "</tool_call>", None, [("unknown_fn", {"n": "5"})]),  # no schema: text
    ],
    "seed_oss": [
        ("Let me check.<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n"
         "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</seed:tool_call>",
         "Let me check.", [W]),
    ],
    "minimax_m2": [
        ('Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
         '<parameter name="city">Tokyo</parameter>\n<parameter name="days">3</parameter>\n'
         '</invoke>\n<invoke name="add">\n<parameter name="a">1.5</parameter>\n'
         '<parameter name="b">2</parameter>\n</invoke>\n</minimax:tool_call>', "Checking.\n",
         [W, ADD]),
    ],
    "glm45": [
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Tokyo</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", None, [W]),
        ("Let me look.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Tokyo"
         "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call><tool_call>add"
         "<arg_key>a</arg_key><arg_value>1.5</arg_value><arg_key>b</arg_key><arg_value>2"
         "</arg_value></tool_call>", "Let me look.", [W, ADD]),
    ],
    "step3": [
        ("Checking.<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>"
         '<steptml:invoke name="get_weather"><steptml:parameter name="city">Tokyo'
         '</steptml:parameter><steptml:parameter name="days">3</steptml:parameter>'
         "</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>", "Checking.", [W]),
    ],
    "openai": [
        ("<|channel|>analysis<|message|>User asks for the weather. Use get_weather.<|end|>"
         "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
         '<|message|>{"city": "Tokyo", "days": 3}', None, [W]),
        ("<|channel|>analysis<|message|>Two calls.<|end|><|start|>assistant to=functions.add"
         '<|channel|>commentary json<|message|>{"a": 1.5, "b": 2}<|call|>'
         "<|start|>assistant<|channel|>final<|message|>Here you are.", "Here you are.", [ADD]),
        ("<|channel|>analysis<|message|>Just answer.<|end|><|start|>assistant<|channel|>final"
         "<|message|>It is sunny.", "It is sunny.", []),
        ("<|channel|>commentary to=functions.get_weather<|message|>not json", None,
         [("get_weather", "not json")]),
        ("plain text answer", "plain text answer", []),
    ],
    "granite": [
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}, '
         '{"name": "add", "arguments": {"a": 1.5, "b": 2}}]', None, [W, ADD]),
        ('Sure. <tool_call>[{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}]',
         "Sure. ", [W]),
    ],
    "granite4": [
        ('Before <tool_call>{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}'
         '</tool_call> between <tool_call>{"name": "add", "arguments": {"a": 1.5, "b": 2}}'
         "</tool_call> after", "Before  between  after", [W, ADD]),
    ],
    "granite-20b-fc": [
        ('<function_call> {"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}\n'
         '<function_call> {"name": "add", "arguments": {"a": 1.5, "b": 2}}', None, [W, ADD]),
        ('Let me see. <function_call> {"name": "add", "arguments": {"a": 1.5, "b": 2}}',
         "Let me see. ", [ADD]),
    ],
    "phi4_mini_json": [
        ('functools[{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}, '
         '{"name": "add", "parameters": {"a": 1.5, "b": 2}}]', None, [W, ADD]),
        ("The answer is 4.", "The answer is 4.", []),
    ],
    "internlm": [
        ('Let me check.<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": '
         '{"city": "Tokyo", "days": 3}}<|action_end|>', "Let me check.", [W]),
    ],
    "jamba": [
        (' <tool_calls>[\n    {"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}},'
         '\n    {"name": "add", "arguments": {"a": 1.5, "b": 2}}\n]</tool_calls>', None,
         [W, ADD]),
        ('Checking. <tool_calls>[{"name": "add", "arguments": {"a": 1.5, "b": 2}}]'
         "</tool_calls>", "Checking. ", [ADD]),
    ],
    "hunyuan_a13b": [
        ('<tool_calls>[{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}, '
         '{"name": "add", "arguments": {"a": 1.5, "b": 2}}]</tool_calls>', None, [W, ADD]),
    ],
    "xlam": [
        ('[{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}, '
         '{"name": "add", "arguments": {"a": 1.5, "b": 2}}]', None, [W, ADD]),
        ('I will call it.\n```json\n[{"name": "get_weather", "arguments": {"city": "Tokyo", '
         '"days": 3}}]\n```', "I will call it.\n", [W]),
        ('<tool_call>[{"name": "add", "arguments": {"a": 1.5, "b": 2}}]</tool_call>', None,
         [ADD]),
        ("No tools needed.", "No tools needed.", []),
    ],
    "ernie45": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}\n'
         "</tool_call>", None, [W]),
    ],
    "longcat": [
        ('Okay.<longcat_tool_call>{"name": "add", "arguments": {"a": 1.5, "b": 2}}'
         "</longcat_tool_call>", "Okay.", [ADD]),
    ],
}
ALIASES = {"qwen3_json": "hermes", "llama4_json": "llama3_json", "qwen3_xml": "qwen3_coder",
           "glm47": "glm45"}
PARAMS = [(name, i, case) for name in TOOL_PARSERS
          for i, case in enumerate(CASES[ALIASES.get(name, name)])]

# The formats' markers, each one token of its model's tokenizer (streamed as one piece).
MARKERS = sorted({m for m in re.findall(
    r"<[|｜][^<>]*?[|｜]>|\[/?[A-Z_]+\]|</?[a-z_:]+>",
    " ".join(text for cases in CASES.values() for text, _, _ in cases))}, key=len, reverse=True)
_TOKEN = re.compile("|".join(map(re.escape, MARKERS)) + r"|\w{1,4}|\s|[^\w\s]")


def pseudo_tokens(text: str) -> list[str]:
    pieces = _TOKEN.findall(text)
    assert "".join(pieces) == text
    return pieces


def chunks(text: str, sizes: list[int]) -> list[str]:
    out, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        out.append(text[i:i + n])
        i, k = i + n, k + 1
    return out


def as_json(calls):
    return [(n, json.loads(a) if isinstance(a, str) and a[:1] in "{[" else a) for n, a in calls]


def test_at_least_the_families_the_models_need_are_registered():
    assert len(TOOL_PARSERS) >= 15
    assert set(TOOL_PARSERS) == set(CASES) | set(ALIASES)


@pytest.mark.parametrize("name, i, case", PARAMS, ids=[f"{n}-{i}" for n, i, _ in PARAMS])
def test_whole_text(name, i, case):
    text, content, calls = case
    parser = make_tool_parser(name)
    got_content, got_calls = parser.parse(text, TOOLS)
    assert got_content == content
    assert as_json(got_calls) == [(n, a) for n, a in calls]


@pytest.mark.parametrize("name, i, case", PARAMS, ids=[f"{n}-{i}" for n, i, _ in PARAMS])
@pytest.mark.parametrize("split", ["tokens", "1", "3-1-4-1-5-9"])
def test_streamed_text_adds_up_to_the_whole(name, i, case, split):
    text, content, calls = case
    pieces = (pseudo_tokens(text) if split == "tokens" else [text] if split == "whole"
              else chunks(text, [int(s) for s in split.split("-")]))
    stream = ToolStream(plan_tools(TOOLS, "auto", make_tool_parser(name)))
    got, deltas = "", []
    for k, piece in enumerate(pieces):
        delta, calls_now = stream.feed(piece, False)
        got += delta
        deltas += calls_now
    delta, calls_now = stream.feed("", True)
    got += delta
    deltas += calls_now
    assert got == (content or "")
    assert [d.index for d in deltas] == list(range(len(calls)))
    assert as_json([(d.function.name, d.function.arguments) for d in deltas]) == \
        [(n, a) for n, a in calls]


def test_content_before_a_call_streams_as_it_comes():
    stream = ToolStream(plan_tools(TOOLS, "auto", make_tool_parser("kimi_k2")))
    assert stream.feed("I'll check", False) == ("I'll check", [])
    assert stream.feed(".<|tool_calls_sec", False) == (".", [])  # a marker's beginning: held
    assert stream.feed("tion_begin|>", False) == ("", [])


def test_xml_parameters_are_typed_by_the_schema_and_kept_as_text_without_one():
    parser = make_tool_parser("qwen3_coder")
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
            "<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>")
    _, [(_, args)] = parser.parse(text, TOOLS)
    assert json.loads(args) == {"city": "42", "days": "three"}  # a string stays; no int: text
    _, [(_, args)] = parser.parse(text, None)
    assert json.loads(args) == {"city": "42", "days": "three"}


def test_parsers_whose_markers_are_special_tokens_keep_them_in_the_text():
    for name in ("hermes", "mistral", "kimi_k2", "deepseek_v3", "openai", "internlm", "jamba"):
        assert make_tool_parser(name).skip_special_tokens is False, name
    assert make_tool_parser("pythonic").skip_special_tokens is True


def test_unknown_names_are_refused_with_the_list():
    with pytest.raises(ValueError, match="tool_call_parser must be one of .*hermes"):
        make_tool_parser("no_such_parser")


def test_a_request_keeps_special_tokens_when_its_parser_needs_them(small_engine):
    from argparse import Namespace

    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.entrypoints.openai.api_server import settings_from_args
    from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat

    def params(parser: str, **request):
        engine = AsyncLLMEngine(small_engine)
        settings = settings_from_args(Namespace(tool_call_parser=parser,
                                                enable_auto_tool_choice=True), engine)
        chat = OpenAIServingChat(engine, settings)
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **request)
        return chat._prepare(req)[1]

    assert params("hermes", tools=TOOLS).skip_special_tokens is False
    assert params("hermes", tools=TOOLS, tool_choice="none").skip_special_tokens is True
    assert params("hermes").skip_special_tokens is True  # no tools
    assert params("pythonic", tools=TOOLS).skip_special_tokens is True


HARMONY = ("<|channel|>analysis<|message|>Need Tokyo's weather.<|end|><|start|>assistant"
           "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>"
           'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Tokyo", '
           '"days": 3}')


@pytest.mark.parametrize("split", ["tokens", "1", "3-1-4-1-5-9", "whole"])
def test_gpt_oss_reasoning_then_tool_calls_streamed_as_the_server_does(split):
    from pagedserve.reasoning import reasoning_parser_class

    reasoner = reasoning_parser_class("openai_gptoss")(1, 2)
    pieces = (pseudo_tokens(HARMONY) if split == "tokens" else [HARMONY] if split == "whole"
              else chunks(HARMONY, [int(s) for s in split.split("-")]))
    thinking = reasoner.stream()
    tools = ToolStream(plan_tools(TOOLS, "auto", make_tool_parser("openai")))
    reasoning = content = ""
    calls = []
    for k, piece in enumerate(pieces + [""]):
        finished = k == len(pieces)
        r, text = thinking.feed(piece, finished)
        c, deltas = tools.feed(text, finished)
        reasoning, content, calls = reasoning + r, content + c, calls + deltas
    assert reasoning == "Need Tokyo's weather."
    assert content == "Checking."
    assert as_json([(d.function.name, d.function.arguments) for d in calls]) == [W]
    whole_r, whole_c = reasoner.split(HARMONY)
    assert (whole_r, make_tool_parser("openai").parse(whole_c)[0]) == (reasoning, content)
