"""POST /v1/chat/completions on the real server (the tiny tokenizer has no chat template, so the
documented plain default applies), and the tokenizer endpoints."""

import asyncio

import pytest

from pagedserve import SamplingParams
from pagedserve.engine.chat_template import PLAIN_TEMPLATE
from server_utils import sse_events

pytestmark = pytest.mark.timeout(60)

MESSAGES = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What does the module provide?"},
]


def rendered_ids(tok, messages):
    text = tok.apply_chat_template(messages, chat_template=PLAIN_TEMPLATE,
                                   add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


def test_chat_renders_the_default_template_and_equals_the_offline_engine(client, server,
                                                                         offline_llm):
    tok = offline_llm.get_tokenizer()
    ids = rendered_ids(tok, MESSAGES)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    ref = offline_llm.generate([{"prompt_token_ids": ids}],
                               SamplingParams(temperature=0, max_tokens=8),
                               use_tqdm=False)[0].outputs[0]
    resp = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=8,
                                          temperature=0)
    (choice,) = resp.choices
    assert resp.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == 8 and resp.usage.total_tokens == len(ids) + 8


def test_max_completion_tokens_limits_the_answer(client, server):
    resp = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                          max_completion_tokens=3, temperature=0)
    assert resp.usage.completion_tokens == 3


def test_request_chat_template_replaces_the_default(http, server, offline_llm):
    tok = offline_llm.get_tokenizer()
    resp = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 1,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }).json()
    assert resp["usage"]["prompt_tokens"] == len(tok("hello world").input_ids)


def test_text_content_parts_are_joined_like_a_string(http, server):
    parts = [{"type": "text", "text": "What does"}, {"type": "text", "text": "it provide?"}]
    as_parts = http.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]})
    as_text = http.post("/tokenize", json={
        "messages": [{"role": "user", "content": "What does\nit provide?"}]})
    assert as_parts.status_code == 200 and as_parts.json() == as_text.json()


def test_chat_logprobs_have_the_chat_format_with_top_logprobs(client, server):
    resp = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.bytes == list(item.token.encode("utf-8"))
        # The greedy token is the most likely one.
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True)


def test_async_chat_stream_starts_with_the_role_and_joins_to_the_plain_answer(
        async_client_factory, server):
    async def main():
        client = async_client_factory()
        plain = await client.chat.completions.create(model=server.model, messages=MESSAGES,
                                                     max_tokens=12, temperature=0)
        stream = await client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        await client.close()
        return plain, chunks

    plain, chunks = asyncio.run(main())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens


def test_chat_stream_n2_has_one_role_and_one_finish_chunk_per_choice(http, server):
    with http.stream("POST", "/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 5,
        "stream": True,
    }) as resp:
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-1]]
    for index in (0, 1):
        mine = [c for c in choices if c["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert sum(1 for c in mine if "role" in c["delta"]) == 1
        assert sum(1 for c in mine if c["finish_reason"]) == 1
        assert mine[-1]["finish_reason"] == "length"


def test_models_version_tokenize_and_detokenize(http, server, offline_llm):
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [server.model]
    assert models["data"][0]["max_model_len"] == 512
    import pagedserve

    assert http.get("/version").json() == {"version": pagedserve.__version__}
    tok = offline_llm.get_tokenizer()
    resp = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    ids = tok("hello world").input_ids
    assert resp.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                           "token_strs": tok.convert_ids_to_tokens(ids)}
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == rendered_ids(tok, MESSAGES)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "hello world"}
