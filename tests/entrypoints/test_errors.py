"""Every error is OpenAI's `{"error": {message, type, param, code}}` with the right status and
the parameter named, and the server keeps serving after each."""

import openai
import pytest

pytestmark = pytest.mark.timeout(60)

OK = {"prompt": "The module", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

CASES = [
    # (name, path, body, status, param)
    ("negative temperature", "/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("top_p above one", "/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p"),
    ("n zero", "/v1/completions", {**OK, "n": 0}, 400, "n"),
    ("n over max_n", "/v1/completions", {**OK, "n": 17, "temperature": 1}, 400, "n"),
    ("n > 1 greedy", "/v1/completions", {**OK, "n": 2, "temperature": 0}, 400, "n"),
    ("logprobs over max", "/v1/completions", {**OK, "logprobs": 21}, 400, "logprobs"),
    ("max_tokens zero", "/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("prompt + max_tokens over max_model_len", "/v1/completions",
     {**OK, "max_tokens": 510}, 400, "max_tokens"),
    ("prompt alone over max_model_len", "/v1/completions",
     {"prompt": [5] * 600, "max_tokens": 1}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {**OK, "prompt": ""}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {**OK, "prompt": []}, 400, "prompt"),
    ("token id outside vocab", "/v1/completions", {**OK, "prompt": [1, 512]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {**OK, "prompt": [1, -1]}, 400, "prompt"),
    ("best_of > n with stream", "/v1/completions",
     {**OK, "best_of": 2, "stream": True, "temperature": 1}, 400, "best_of"),
    ("suffix unsupported", "/v1/completions", {**OK, "suffix": "end"}, 400, "suffix"),
    ("wrong type", "/v1/completions", {**OK, "max_tokens": "many"}, 400, "max_tokens"),
    ("missing prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("bad logit_bias token", "/v1/completions", {**OK, "logit_bias": {"9999": 1}}, 400,
     "logit_bias"),
    ("unknown model", "/v1/completions", {**OK, "model": "gpt-9"}, 404, "model"),
    ("chat negative temperature", "/v1/chat/completions", {**CHAT, "temperature": -1}, 400,
     "temperature"),
    ("chat top_logprobs over max", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat top_logprobs without logprobs", "/v1/chat/completions",
     {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat empty messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400,
     "messages"),
    ("chat image content unsupported", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [
         {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages"),
    ("chat max_completion_tokens over max_model_len", "/v1/chat/completions",
     {**CHAT, "max_completion_tokens": 600}, 400, "max_completion_tokens"),
    ("chat broken template", "/v1/chat/completions",
     {**CHAT, "chat_template": "{% for %}"}, 400, "chat_template"),
    ("chat unknown model", "/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model"),
    ("detokenize outside vocab", "/detokenize", {"tokens": [1, 100000]}, 400, "tokens"),
]


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_invalid_request_gets_openai_error_naming_the_param(http, name, path, body, status,
                                                            param):
    resp = http.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["code"] == status and error["message"]
    assert error["type"] == ("BadRequestError" if status == 400 else "NotFoundError")  # vLLM's


def test_bad_json_is_a_400_in_openai_shape_not_fastapis_422(http):
    resp = http.post("/v1/completions", content=b"{not json",
                     headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert "Invalid JSON" in resp.json()["error"]["message"]
    resp = http.post("/v1/completions", json=["a", "list"])
    assert resp.status_code == 400 and "JSON object" in resp.json()["error"]["message"]


def test_unknown_route_is_a_404_in_openai_shape(http):
    resp = http.get("/v1/nothing-here")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == 404


def test_unknown_fields_are_ignored_with_a_logged_warning(http, server):
    resp = http.post("/v1/completions", json={**OK, "some_future_field": {"x": 1}})
    assert resp.status_code == 200
    assert "some_future_field" in server.log_text()


def test_openai_client_raises_its_typed_errors(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="x", max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)


def test_server_keeps_serving_after_every_error(http, client, server):
    for _, path, body, _, _ in CASES:
        http.post(path, json=body)
    assert http.get("/health").status_code == 200
    resp = client.completions.create(model=server.model, prompt="The module", max_tokens=3,
                                     extra_body={"ignore_eos": True})  # no early EOS draw
    assert resp.usage.completion_tokens == 3
