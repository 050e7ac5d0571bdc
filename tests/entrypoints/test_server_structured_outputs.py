"""Structured outputs on the real server: `response_format` (json_object, json_schema), vLLM's
`structured_outputs` and the `guided_*` fields, on completions and chat, streamed or not; the
outputs match every time; invalid constraints are 400s naming the field."""

import json
import re

import jsonschema
import pytest

from server_utils import sse_events

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "days"], "additionalProperties": False,
}
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.com"
MESSAGES = [{"role": "user", "content": "Plan a trip."}]


def test_chat_json_schema_response_format_always_validates(client, server):
    for seed in range(6):
        resp = client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=80, seed=seed, n=2,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "trip", "schema": SCHEMA}})
        for choice in resp.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_completions_take_structured_outputs_and_guided_fields(client, server):
    for body in ({"structured_outputs": {"regex": EMAIL}}, {"guided_regex": EMAIL}):
        resp = client.completions.create(model=server.model, prompt="Mail:", max_tokens=30,
                                         n=3, seed=1, extra_body=body)
        for choice in resp.choices:
            assert re.fullmatch(EMAIL, choice.text), (body, choice.text)
    resp = client.completions.create(model=server.model, prompt="Pick:", max_tokens=10,
                                     temperature=0, extra_body={"guided_choice": ["up", "down"]})
    assert resp.choices[0].text in ("up", "down")
    resp = client.completions.create(
        model=server.model, prompt="Digits:", max_tokens=10, seed=3,
        extra_body={"guided_grammar": 'root ::= [0-9] [0-9] "-" [0-9]'})
    assert re.fullmatch(r"\d\d-\d", resp.choices[0].text)
    resp = client.completions.create(model=server.model, prompt="Trip:", max_tokens=80, seed=2,
                                     extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(resp.choices[0].text), SCHEMA)


def test_json_object_response_format_starts_an_object(client, server):
    resp = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=40,
                                          seed=0, response_format={"type": "json_object"})
    text = resp.choices[0].message.content
    assert text.lstrip().startswith("{")
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_streamed_constrained_chat_equals_the_non_streamed_answer(http, server):
    body = {"messages": MESSAGES, "max_tokens": 80, "seed": 4,
            "structured_outputs": {"json": SCHEMA}}
    whole = http.post("/v1/chat/completions", json=body).json()
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = sse_events(r.iter_lines())
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]
                   if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields, param, message", [
    ({"guided_regex": "a(b"}, "guided_regex", "guided_regex is not a valid regular expression"),
    ({"guided_json": '{"type": '}, "guided_json", "not valid JSON"),
    ({"guided_json": {"type": "nope"}}, "guided_json", "not a supported JSON schema"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "not a valid EBNF"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unexpected keyword"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type must be"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice",
     "one structured-output constraint"),
])
def test_invalid_constraints_are_400s_naming_the_field(http, server, endpoint, fields, param,
                                                       message):
    body = {"max_tokens": 5, **fields}
    body.update({"prompt": "x"} if "chat" not in endpoint else {"messages": MESSAGES})
    r = http.post(endpoint, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    assert http.get("/health").status_code == 200


def test_text_response_format_is_unconstrained(client, server):
    resp = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4,
                                          temperature=0, response_format={"type": "text"})
    assert resp.choices[0].finish_reason == "length"
