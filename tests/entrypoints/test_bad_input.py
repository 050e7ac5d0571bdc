"""The bad-input corpus (bad_input_corpus.py): every case gets its 4xx in OpenAI's error shape
naming the problem, and the server answers the next request; and a property-based test:
random request bodies drawn from the request schemas never get a 5xx nor kill the server."""

import json

import pytest
from bad_input_corpus import CASES, encode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.bench.reliability import check_error, run_corpus

pytestmark = pytest.mark.timeout(180)


def test_the_corpus_has_at_least_40_cases_covering_every_post_endpoint():
    assert len(CASES) >= 40
    assert {path for _, path, *_ in CASES} == {
        "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/responses"}


@pytest.mark.parametrize("name,path,body,status,mentions", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_4xx_naming_the_problem_and_the_server_answers_the_next(
        http, name, path, body, status, mentions):
    r = http.post(path, content=encode(body), headers={"content-type": "application/json"})
    assert check_error(r, status, mentions) is None, check_error(r, status, mentions)
    after = http.post("/v1/completions", json={"prompt": "The module", "max_tokens": 2})
    assert after.status_code == 200, after.text


def test_run_corpus_counts_no_crash_on_the_shared_server(server):
    # The same corpus through the scripts' runner (what scripts/bad_input.py reports).
    result = run_corpus(server.url, CASES[:5], encode)
    assert (result.tried, result.answered_4xx, result.crashes) == (5, 5, 0), result.failures


def test_unknown_extra_fields_are_ignored_not_refused(http, server):
    r = http.post("/v1/completions", json={"prompt": "The", "max_tokens": 2,
                                           "no_such_field_xyz": {"a": [1]}})
    assert r.status_code == 200, r.text
    assert "no_such_field_xyz" in server.log_text()


# --- property-based ------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10)

_SAMPLING = {
    "max_tokens": st.one_of(st.integers(-3, 40), _values),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), _values),
    "top_p": st.one_of(st.floats(-0.5, 1.5, allow_nan=False), _values),
    "top_k": st.one_of(st.integers(-2, 600), _values),
    "n": st.one_of(st.integers(-1, 20), _values),
    "best_of": st.one_of(st.integers(-1, 20), _values),
    "logprobs": st.one_of(st.integers(-1, 25), st.booleans(), _values),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=18), _values),
    "seed": st.one_of(st.integers(-(2**65), 2**65), _values),
    "stream": st.one_of(st.booleans(), _values),
    "presence_penalty": st.one_of(st.floats(-3, 3, allow_nan=False), _values),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 600), max_size=3), _values),
    "logit_bias": st.one_of(st.dictionaries(st.sampled_from(["1", "5", "-1", "600", "x"]),
                                            st.floats(-200, 200, allow_nan=False), max_size=2),
                            _values),
    "echo": st.one_of(st.booleans(), _values),
    "min_tokens": st.one_of(st.integers(-1, 10), _values),
    "use_beam_search": st.booleans(),
}
_PROMPT = st.one_of(st.text(max_size=30), st.lists(st.integers(-3, 600), max_size=8),
                    st.lists(st.text(max_size=10), max_size=3), _values)
_MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool", "bot"]), _values),
    "content": st.one_of(st.text(max_size=30), _values,
                         st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                         "text": st.text(max_size=10)}),
                                  max_size=2)),
})
_BODIES = st.one_of(
    st.tuples(st.just("/v1/completions"),
              st.fixed_dictionaries({}, optional={"prompt": _PROMPT, **_SAMPLING})),
    st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries({}, optional={
        "messages": st.one_of(st.lists(_MESSAGE, max_size=3), _values), **_SAMPLING,
        "top_logprobs": st.one_of(st.integers(-1, 25), _values)})),
    st.tuples(st.just("/tokenize"), st.fixed_dictionaries({}, optional={
        "prompt": _PROMPT, "messages": st.lists(_MESSAGE, max_size=2),
        "add_special_tokens": _values})),
    st.tuples(st.just("/v1/responses"), st.fixed_dictionaries({}, optional={
        "input": st.one_of(st.text(max_size=20), _values, st.lists(st.one_of(
            _MESSAGE, st.fixed_dictionaries({"type": st.sampled_from(
                ["message", "function_call", "function_call_output", "reasoning", "x"])},
                optional={"role": _values, "content": _values, "name": _values,
                          "call_id": _values, "arguments": _values, "output": _values})),
            max_size=3)),
        "instructions": st.one_of(st.text(max_size=10), _values),
        "max_output_tokens": st.one_of(st.integers(-2, 8), _values),
        "tools": st.one_of(_values, st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "web_search"])},
            optional={"name": _values, "parameters": _values}), max_size=2)),
        "tool_choice": _values, "temperature": _values, "stream": st.booleans(),
        "previous_response_id": _values, "text": _values})),
    st.tuples(st.just("/detokenize"), st.fixed_dictionaries({}, optional={
        "tokens": st.one_of(st.lists(st.integers(-3, 600), max_size=5), _values)})),
)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=_BODIES)
def test_random_request_bodies_never_get_a_5xx_nor_kill_the_server(http, server, case):
    path, body = case
    if isinstance(body.get("max_tokens"), int):  # keep generations short: this is about input
        body["max_tokens"] = min(body["max_tokens"], 8)
    if path == "/v1/responses" and not isinstance(body.get("max_output_tokens"), int):
        body["max_output_tokens"] = 8
    r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text[:500])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert server.proc.poll() is None
