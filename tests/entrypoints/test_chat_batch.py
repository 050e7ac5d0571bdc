"""vLLM's POST /v1/chat/completions/batch on the real server: one choice per conversation, in
order, each what /v1/chat/completions answers alone (greedy), usage summed, shared fields
(structured outputs, logprobs) applied to every conversation; streaming, n > 1, tools and bad
`messages` are 400s naming the field."""

import pytest

pytestmark = pytest.mark.timeout(300)

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three"}],
    [{"role": "user", "content": "JSON:"}],
]


def test_each_choice_is_its_conversations_own_answer_in_order(http, server):
    shared = {"model": server.model, "max_tokens": 8, "temperature": 0, "logprobs": True,
              "top_logprobs": 2}
    resp = http.post("/v1/chat/completions/batch", json={**shared, "messages": CONVERSATIONS})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    prompt_tokens = completion_tokens = 0
    for conversation, choice in zip(CONVERSATIONS, body["choices"]):
        alone = http.post("/v1/chat/completions",
                          json={**shared, "messages": conversation}).json()
        assert choice["message"] == alone["choices"][0]["message"]
        # (exactly equal with the batch-invariant fp32 kernels; close without them)
        got, want = choice["logprobs"]["content"], alone["choices"][0]["logprobs"]["content"]
        assert [t["token"] for t in got] == [t["token"] for t in want]
        assert [t["logprob"] for t in got] == pytest.approx([t["logprob"] for t in want],
                                                            rel=1e-4, abs=1e-5)
        assert [len(t["top_logprobs"]) for t in got] == [2] * len(want)
        assert choice["finish_reason"] == alone["choices"][0]["finish_reason"]
        prompt_tokens += alone["usage"]["prompt_tokens"]
        completion_tokens += alone["usage"]["completion_tokens"]
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == completion_tokens
    assert body["usage"]["total_tokens"] == prompt_tokens + completion_tokens


def test_structured_outputs_constrain_every_conversation(http, server):
    choices = ["red", "green", "blue"]
    resp = http.post("/v1/chat/completions/batch", json={
        "model": server.model, "messages": CONVERSATIONS, "max_tokens": 10, "seed": 3,
        "structured_outputs": {"choice": choices}})
    assert resp.status_code == 200, resp.text
    got = [c["message"]["content"] for c in resp.json()["choices"]]
    assert len(got) == 3 and all(t in choices for t in got), got


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"),
    ({"n": 2}, "n"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": []}, "messages"),
    ({"messages": [CONVERSATIONS[0], []]}, "messages"),
    ({"messages": CONVERSATIONS[0]}, "messages"),  # one conversation, not a list of them
    ({"max_tokens": 0}, "max_tokens"),
])
def test_what_vllm_refuses_is_a_400_naming_the_field(http, server, extra, param):
    body = {"model": server.model, "messages": CONVERSATIONS, "max_tokens": 4, **extra}
    resp = http.post("/v1/chat/completions/batch", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert param in (error["param"] or "") or param in error["message"], error
