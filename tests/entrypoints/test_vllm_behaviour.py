"""vLLM's OpenAI-server behaviours, point by point (the app in process on a tiny Llama):
stream_options rules, custom roles, echo variants, logprobs ordering, vLLM's request fields,
routes, flags."""

import asyncio

import pytest
from app_utils import events, run_app

from pagedserve import LLMEngine, SamplingParams
from pagedserve.config import EngineArgs

pytestmark = pytest.mark.timeout(120)

PROMPT = "The module provides"
USER = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", num_kv_blocks=64,
                                max_model_len=128, max_logprobs=-1))


@pytest.fixture(scope="module")
def tok(llm):
    return llm.tokenizer


def post_all(llm, requests, **flags):
    """POST each (path, body) in turn; the responses."""
    async def main(c):
        return [await c.post(path, json=body) for path, body in requests]

    return run_app(llm, main, **flags)


def _offline(llm, ids, **kw):
    """The engine's output for a token-id prompt, run to completion."""
    llm.add_request("offline", None, SamplingParams(**kw), prompt_token_ids=ids)
    final = None
    while llm.has_unfinished_requests():
        for out in llm.step():
            final = out
    return final


# --- stream_options ----------------------------------------------------------------------------


def test_stream_options_without_stream_is_a_400_on_both_endpoints(llm):
    opts = {"include_usage": True}
    a, b = post_all(llm, [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream_options": opts}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "stream_options": opts}),
    ])
    for resp in (a, b):
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "stream_options"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": USER}),
])
def test_continuous_usage_stats_puts_usage_on_every_chunk_and_include_usage_false_on_none(
        llm, path, body):
    base = {**body, "max_tokens": 4, "ignore_eos": True, "stream": True}
    every, none = post_all(llm, [
        (path, {**base, "stream_options": {"include_usage": True,
                                           "continuous_usage_stats": True}}),
        (path, {**base, "stream_options": {"include_usage": False}}),
    ])
    chunks = events(every)
    # NOTE: a slow reader may get the 4 tokens in one chunk; the usage chunk comes after it
    assert len(chunks) >= 2 and all(c["usage"] is not None for c in chunks)
    if "messages" in body:  # the role chunk too
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[0]["usage"]["completion_tokens"] == 0
    completion = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert completion == sorted(completion) and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c.get("usage") is None for c in events(none))


# --- roles, model ------------------------------------------------------------------------------


def test_any_role_reaches_the_template_and_an_empty_model_means_the_served_one(llm):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    msgs = [{"role": "narrator", "content": "once"}, {"role": "user", "content": "go"}]
    tokenized, chat = post_all(llm, [
        ("/tokenize", {"messages": msgs, "chat_template": template}),
        ("/v1/chat/completions", {"messages": msgs, "model": "", "max_tokens": 2}),
    ])
    assert tokenized.status_code == 200 and chat.status_code == 200
    text = llm.tokenizer.decode(tokenized.json()["tokens"])
    assert text == "[narrator] once\n[user] go\n"
    assert chat.json()["model"] == llm.source.name


# --- echo --------------------------------------------------------------------------------------


def test_echo_of_a_token_id_prompt_echoes_its_special_tokens(llm, tok):
    ids = [tok.bos_token_id, *tok(PROMPT, add_special_tokens=False).input_ids]
    body = {"prompt": ids, "echo": True, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    echoed, plain = post_all(llm, [("/v1/completions", body),
                                   ("/v1/completions", {**body, "echo": False})])
    generated = plain.json()["choices"][0]["text"]
    assert echoed.json()["choices"][0]["text"] == "<s>" + PROMPT + generated


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(llm, tok):
    ids = tok(PROMPT).input_ids
    body = {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    plain, streamed = post_all(llm, [("/v1/completions", body),
                                     ("/v1/completions", {**body, "stream": True})])
    ref = _offline(llm, ids, max_tokens=1, temperature=0, prompt_logprobs=1)
    data = plain.json()
    (choice,) = data["choices"]
    assert choice["text"] == PROMPT
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [ref.prompt_logprobs[i][t].logprob
                                        for i, t in enumerate(ids) if i]
    # Each prompt position lists its own token first (lm-evaluation-harness's is_greedy reads it).
    for i, top in enumerate(lp["top_logprobs"][1:], start=1):
        assert next(iter(top)) == lp["tokens"][i]
        assert len(top) <= 2
    assert data["usage"] == {**data["usage"], "prompt_tokens": len(ids), "completion_tokens": 0}
    chunks = [c for c in events(streamed) if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == PROMPT
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == len(ids)


def test_max_tokens_0_without_echo_is_a_400(llm):
    (resp,) = post_all(llm, [("/v1/completions", {"prompt": PROMPT, "max_tokens": 0})])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens"


def test_chat_echo_starts_the_answer_with_the_continued_message(llm):
    msgs = [*USER, {"role": "assistant", "content": "Well, the"}]
    body = {"messages": msgs, "echo": True, "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 3, "ignore_eos": True,
            "temperature": 0}
    plain, streamed, without = post_all(llm, [
        ("/v1/chat/completions", body),
        ("/v1/chat/completions", {**body, "stream": True}),
        ("/v1/chat/completions", {**body, "echo": False}),
    ])
    generated = without.json()["choices"][0]["message"]["content"]
    assert plain.json()["choices"][0]["message"]["content"] == "Well, the" + generated
    deltas = [c["choices"][0]["delta"].get("content", "") for c in events(streamed)]
    assert deltas[:2] == ["", "Well, the"] and "".join(deltas) == "Well, the" + generated


# --- logprobs ----------------------------------------------------------------------------------


def test_top_logprobs_list_the_chosen_token_first(llm):
    # Tokens named by id: several tokens of the tiny vocabulary decode to the same text.
    comp, chat = post_all(llm, [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "logprobs": 3,
                             "temperature": 1.0, "seed": 3}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 8, "logprobs": True,
                                  "top_logprobs": 3, "temperature": 1.0, "seed": 3,
                                  "ignore_eos": True}),
    ], return_tokens_as_token_ids=True)
    lp = comp.json()["choices"][0]["logprobs"]
    for token, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert next(iter(top)) == token and 3 <= len(top) <= 4
    for entry in chat.json()["choices"][0]["logprobs"]["content"]:
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert len(entry["top_logprobs"]) == 3


def test_logprobs_minus_1_returns_the_whole_vocabulary_with_max_logprobs_minus_1(llm, small_engine):
    body = {"prompt": PROMPT, "max_tokens": 2, "logprobs": -1, "temperature": 0}
    chat_body = {"messages": USER, "max_tokens": 1, "logprobs": True, "top_logprobs": -1}
    whole, chat, streamed, chat_streamed = post_all(llm, [
        ("/v1/completions", body), ("/v1/chat/completions", chat_body),
        ("/v1/completions", {**body, "stream": True}),
        ("/v1/chat/completions", {**chat_body, "stream": True}),
    ], return_tokens_as_token_ids=True)
    for top in whole.json()["choices"][0]["logprobs"]["top_logprobs"]:
        assert len(top) == 512  # every token id of the vocabulary
    assert len(chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 512
    # Streamed (these chunks are built off the event loop): the same entries.
    tops = [t for c in events(streamed) for t in c["choices"][0]["logprobs"]["top_logprobs"]]
    assert tops == whole.json()["choices"][0]["logprobs"]["top_logprobs"]
    content = [e for c in events(chat_streamed) if c["choices"] and c["choices"][0]["logprobs"]
               for e in c["choices"][0]["logprobs"]["content"]]
    assert len(content) == 1 and len(content[0]["top_logprobs"]) == 512
    refused = post_all(small_engine, [("/v1/completions", body),
                                      ("/v1/completions", {**body, "logprobs": None,
                                                           "prompt_logprobs": -1})])
    assert [r.status_code for r in refused] == [400, 400]
    assert [r.json()["error"]["param"] for r in refused] == ["logprobs", "prompt_logprobs"]


# --- request fields ----------------------------------------------------------------------------


def test_return_token_ids_gives_prompt_and_output_ids(llm, tok):
    ids = tok(PROMPT).input_ids
    base = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}
    plain, streamed, chat = post_all(llm, [
        ("/v1/completions", base), ("/v1/completions", {**base, "stream": True}),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "ignore_eos": True,
                                  "return_token_ids": True}),
    ])
    choice = plain.json()["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 5
    assert tok.decode(choice["token_ids"]) == choice["text"]
    chunks = events(streamed)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == ids
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    data = chat.json()
    assert data["prompt_token_ids"][0] == tok.bos_token_id
    assert len(data["prompt_token_ids"]) == data["usage"]["prompt_tokens"]
    assert len(data["choices"][0]["token_ids"]) == 3


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncate_prompt_tokens_keeps_the_chosen_side(llm, tok, side):
    ids = tok("one two three four five six seven eight nine ten").input_ids
    kept = ids[-4:] if side == "left" else ids[:4]
    body = {"prompt": tok.decode(ids, skip_special_tokens=True), "max_tokens": 3,
            "temperature": 0, "truncate_prompt_tokens": 4, "return_token_ids": True}
    if side == "right":
        body["truncation_side"] = "right"
    cut, direct, too_long = post_all(llm, [
        ("/v1/completions", body),
        ("/v1/completions", {"prompt": kept, "max_tokens": 3, "temperature": 0}),
        ("/v1/completions", {**body, "truncate_prompt_tokens": 129}),
    ])
    data = cut.json()
    assert data["usage"]["prompt_tokens"] == 4 and data["choices"][0]["prompt_token_ids"] == kept
    assert data["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "truncate_prompt_tokens"


def test_allowed_token_ids_are_the_only_tokens_sampled(llm):
    allowed = [100, 200, 300]
    resps = post_all(llm, [("/v1/completions", {
        "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": s,
        "allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True,
    }) for s in range(4)])
    seen = {t for r in resps for t in r.json()["choices"][0]["token_ids"]}
    assert seen <= set(allowed) and len(seen) > 1
    (bad,) = post_all(llm, [("/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [9999]})])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_are_never_generated(llm, tok):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    (free,) = post_all(llm, [("/v1/completions", body)])
    out = free.json()["choices"][0]["token_ids"]
    # A two-token word the greedy answer contains, and a single token it starts with.
    word = tok.decode(out[2:4])
    single = tok.decode(out[:1])
    (banned,) = post_all(llm, [("/v1/completions", {**body, "bad_words": [word, single]})])
    got = banned.json()["choices"][0]["token_ids"]
    assert got[0] != out[0]
    pairs = list(zip(got, got[1:]))
    for w in (word, single):
        seq = tok.encode(w.lstrip(), add_special_tokens=False)
        if len(seq) == 1:
            assert seq[0] not in got
        else:
            assert tuple(seq[:2]) not in pairs or len(seq) > 2


def test_cache_salt_is_validated_and_isolates_prefix_cache_hits(llm, tok):
    prompt = "word " * 60  # several full blocks
    body = {"prompt": prompt, "max_tokens": 1}
    resps = post_all(llm, [
        ("/v1/completions", {**body, "cache_salt": "alice"}),
        ("/v1/completions", {**body, "cache_salt": "alice"}),
        ("/v1/completions", {**body, "cache_salt": "bob"}),
        ("/v1/completions", {**body, "cache_salt": ""}),
    ], enable_prompt_tokens_details=True)
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in resps[:3]]
    assert cached[0] == 0 and cached[1] >= 48 and cached[2] == 0
    assert resps[3].status_code == 400 and resps[3].json()["error"]["param"] == "cache_salt"
    (plain,) = post_all(llm, [("/v1/completions", body)])  # no details without the flag
    assert plain.json()["usage"].get("prompt_tokens_details") is None


# --- routes ------------------------------------------------------------------------------------


def test_model_route_tokenizer_info_and_invocations(llm):
    name = llm.source.name
    resps = post_all(llm, [])  # warm nothing: routes below are GETs and POSTs

    async def main(c):
        return [await c.get(f"/v1/models/{name}"), await c.get("/v1/models/other"),
                await c.get("/tokenizer_info"),
                await c.post("/invocations", json={"prompt": PROMPT, "max_tokens": 2}),
                await c.post("/invocations", json={"messages": USER, "max_tokens": 2}),
                await c.post("/invocations", json={"input": "x"}),
                await c.get("/no/such/route")]

    got = run_app(llm, main, enable_tokenizer_info_endpoint=True)
    model, missing, info, comp, chat, bad, route = got
    assert resps == []
    assert model.json()["id"] == name and model.json()["object"] == "model"
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    assert info.json()["eos_token"] == "</s>" and info.json()["bos_token"] == "<s>"
    assert comp.json()["object"] == "text_completion"
    assert chat.json()["object"] == "chat.completion"
    assert bad.status_code == 400 and set(bad.json()["error"]) >= {"message", "type", "code"}
    assert route.status_code == 404 and route.json()["error"]["type"] == "Not Found"
    (hidden,) = run_app(llm, lambda c: asyncio.gather(c.get("/tokenizer_info")))
    assert hidden.status_code == 404


# --- flags -------------------------------------------------------------------------------------


def test_chat_template_flag_takes_a_file_or_inline_source(llm, tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    for value in (str(path), template):
        (resp,) = post_all(llm, [("/tokenize", {"messages": USER})], chat_template=value)
        assert llm.tokenizer.decode(resp.json()["tokens"]) == "<user>hi there"
    with pytest.raises(ValueError, match="chat-template"):
        post_all(llm, [], chat_template=str(tmp_path / "missing.jinja"))


def test_request_id_headers_echo_the_clients_id_or_make_one(llm):
    async def main(c):
        return (await c.get("/health", headers={"X-Request-Id": "abc-1"}),
                await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}))

    mine, made = run_app(llm, main, enable_request_id_headers=True)
    assert mine.headers["x-request-id"] == "abc-1" and len(made.headers["x-request-id"]) >= 16
    plain, _ = run_app(llm, main)
    assert "x-request-id" not in plain.headers


def test_return_tokens_as_token_ids_names_tokens_by_id(llm):
    body = {"prompt": PROMPT, "max_tokens": 3, "logprobs": 1, "return_token_ids": True}
    (resp,) = post_all(llm, [("/v1/completions", body)], return_tokens_as_token_ids=True)
    choice = resp.json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"]
               for k in top)


def test_force_include_usage_ends_every_stream_with_usage(llm):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True, "ignore_eos": True}
    (forced,) = post_all(llm, [("/v1/completions", body)], enable_force_include_usage=True)
    chunks = events(forced)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    (plain,) = post_all(llm, [("/v1/completions", body)])
    assert all(c["choices"] for c in events(plain))


def test_server_load_tracking_counts_requests_in_progress(llm):
    async def main(c):
        body = {"prompt": PROMPT, "max_tokens": 100, "ignore_eos": True}
        request = asyncio.ensure_future(c.post("/v1/completions", json=body))
        during = 0
        while not request.done() and not during:
            during = (await c.get("/load")).json()["server_load"]
            await asyncio.sleep(0.005)
        await request
        await c.post("/v1/completions", json={**body, "max_tokens": 3, "stream": True})
        return during, (await c.get("/load")).json()["server_load"]

    assert run_app(llm, main, enable_server_load_tracking=True) == (1, 0)


# --- metrics -----------------------------------------------------------------------------------


def test_metrics_that_vllms_tests_read_are_served_under_the_pagedserve_prefix(llm):
    from server_utils import metric

    async def main(c):
        await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "n": 2,
                                              "temperature": 1.0, "ignore_eos": True})
        await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 7,
                                              "ignore_eos": True})
        return (await c.get("/metrics")).text

    text = run_app(llm, main)
    name = llm.source.name
    assert metric(text, "pagedserve:request_params_n_count", model_name=name) == 2
    assert metric(text, "pagedserve:request_params_n_sum", model_name=name) == 3
    assert metric(text, "pagedserve:request_params_max_tokens_sum", model_name=name) == 12
    assert metric(text, "pagedserve:request_num_preemptions_count", model_name=name) == 2
    for timing in ("inference", "prefill", "decode"):
        assert metric(text, f"pagedserve:request_{timing}_time_seconds_count",
                      model_name=name) == 2
    # Every token computed went through some step: prompt tokens + generated tokens.
    prompt_len = len(llm.tokenizer(PROMPT).input_ids)
    total = metric(text, "pagedserve:iteration_tokens_total_sum", model_name=name)
    assert prompt_len + 17 <= total <= 2 * prompt_len + 17
    assert metric(text, "pagedserve:num_requests_waiting_by_reason", model_name=name,
                  reason="capacity") == 0
    assert metric(text, "pagedserve:num_requests_waiting_by_reason", model_name=name,
                  reason="deferred") == 0
    assert metric(text, "pagedserve:cache_config_info", block_size="16",
                  num_gpu_blocks="64") == 1
