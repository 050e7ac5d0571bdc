"""Tool calling on the real server (started with --enable-auto-tool-choice --tool-call-parser
hermes) through the openai client: `required` and a named function always give calls whose
arguments match the function's parameters; `auto` parses the model's text; `none` is plain text;
streamed tool-call deltas add up to the non-streamed calls; the template receives the tools."""

import json

import jsonschema
import pytest

from server_utils import sse_events

pytestmark = pytest.mark.timeout(300)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}</tool_call>')


def chat(client, server, **kw):
    return client.chat.completions.create(model=server.model, messages=MESSAGES, tools=TOOLS,
                                          **kw)


def test_named_function_always_gets_valid_arguments(client, server):
    for seed in range(6):
        resp = chat(client, server, max_tokens=60, seed=seed, n=2,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
        for choice in resp.choices:
            (call,) = choice.message.tool_calls
            assert call.type == "function" and call.function.name == "get_weather"
            assert call.id.startswith("chatcmpl-tool-")
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
            assert choice.finish_reason == "stop" and not choice.message.content


def test_required_always_calls_tools_with_valid_arguments(client, server):
    # One call per answer (parallel_tool_calls false): a random model never closes a list of
    # calls by itself, so without the bound the answer would only end at max_tokens.
    for seed in range(6):
        resp = chat(client, server, max_tokens=200, seed=seed, tool_choice="required",
                    parallel_tool_calls=False)
        (choice,) = resp.choices
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_parses_hermes_tool_calls_from_the_text(client, server):
    # force the model's text, so that the parser has a call to find
    resp = chat(client, server, max_tokens=200, tool_choice="auto",
                extra_body={"guided_choice": [HERMES_CALL]})
    (choice,) = resp.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_auto_and_none_without_calls_answer_plain_text(client, server):
    for choice_mode in ("auto", "none"):
        resp = chat(client, server, max_tokens=20, tool_choice=choice_mode,
                    extra_body={"guided_choice": ["Sunny in Paris"]})
        (choice,) = resp.choices
        assert choice.message.content == "Sunny in Paris" and not choice.message.tool_calls
        assert choice.finish_reason == "stop"
    resp = chat(client, server, max_tokens=200, tool_choice="none",
                extra_body={"guided_choice": [HERMES_CALL]})
    assert resp.choices[0].message.content == HERMES_CALL  # none: never parsed


def streamed_calls(http, body):
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    calls, content, finish = {}, "", None
    for e in events[:-1]:
        for c in e["choices"]:
            delta = c["delta"]
            content += delta.get("content") or ""
            finish = c["finish_reason"] or finish
            for tc in delta.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or tc.get("id")
                fn = tc.get("function") or {}
                entry["name"] += fn.get("name") or ""
                entry["arguments"] += fn.get("arguments") or ""
    return [calls[i] for i in sorted(calls)], content, finish


@pytest.mark.parametrize("tool_choice, extra", [
    ({"type": "function", "function": {"name": "get_weather"}}, {}),
    ("required", {"parallel_tool_calls": False}),
    ("auto", {"guided_choice": ["Well. " + HERMES_CALL]}),
])
def test_streamed_tool_call_deltas_add_up_to_the_non_streamed_calls(http, server, tool_choice,
                                                                     extra):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "seed": 5,
            "max_tokens": 200, **extra}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    calls, content, finish = streamed_calls(http, body)
    assert finish == whole["finish_reason"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (t["function"]["name"], t["function"]["arguments"]) for t in whole["message"]["tool_calls"]]
    assert all(c["id"] for c in calls) and calls
    assert content == (whole["message"]["content"] or "")


def test_the_chat_template_receives_the_tools(http, server, offline_llm):
    template = ("{% for t in tools %}{{ t.function.name }};{% endfor %}"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    r = http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1,
        "chat_template": template}).json()
    text = "get_weather;get_time;" + MESSAGES[0]["content"]
    tok = offline_llm.get_tokenizer()
    assert r["usage"]["prompt_tokens"] == len(tok(text, add_special_tokens=False).input_ids)


def test_tool_results_in_the_conversation_are_accepted(client, server):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    resp = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS,
                                          tool_choice="none", max_tokens=3,
                                          # NOTE: the random tiny model may draw EOS early
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize("fields, param, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto', 'required'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools",
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0] must be"),
    ({"tool_choice": "required", "guided_regex": "a+"}, "tool_choice",
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "x"}}}],
      "tool_choice": "required"}, "tools", "parameters schema"),
])
def test_invalid_tool_requests_are_400s(http, server, fields, param, message):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 5, **fields}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def test_tool_choice_without_tools_is_a_400(http, server):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5,
                                                "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
