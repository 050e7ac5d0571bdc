"""POST /v1/completions on the real server with the official `openai` client and raw HTTP."""

import pytest

from pagedserve import SamplingParams
from server_utils import sse_events

pytestmark = pytest.mark.timeout(60)

PROMPT = "The module provides"


def offline(llm, prompt, **kw):
    kw.setdefault("temperature", 0.0)
    return llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def test_greedy_completion_equals_the_offline_engine_with_exact_usage(client, server,
                                                                      offline_llm):
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8,
                                     temperature=0)
    ref = offline(offline_llm, PROMPT, max_tokens=8)
    (choice,) = resp.choices
    assert resp.object == "text_completion" and resp.model == server.model
    assert choice.index == 0 and choice.text == ref.outputs[0].text != ""
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == len(ref.prompt_token_ids) + 8


def test_model_field_may_be_omitted_and_defaults_to_the_served_model(http, server):
    resp = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert resp.status_code == 200 and resp.json()["model"] == server.model


def test_prompt_lists_and_token_ids_give_one_choice_per_prompt_in_order(client, server,
                                                                        offline_llm):
    tok = offline_llm.get_tokenizer()
    prompts = ["The module provides", "Return the value of", "A list of"]
    refs = [offline(offline_llm, p, max_tokens=4).outputs[0].text for p in prompts]
    resp = client.completions.create(model=server.model, prompt=prompts, max_tokens=4,
                                     temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == refs
    ids = [tok(p).input_ids for p in prompts]
    assert resp.usage.prompt_tokens == sum(len(i) for i in ids)
    assert resp.usage.completion_tokens == 12
    one = client.completions.create(model=server.model, prompt=ids[1], max_tokens=4,
                                    temperature=0)
    assert one.choices[0].text == refs[1]
    many = client.completions.create(model=server.model, prompt=ids, max_tokens=4,
                                     temperature=0)
    assert [c.text for c in many.choices] == refs


def test_n2_returns_two_indexed_choices_and_usage_counts_both(client, server):
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, n=2,
                                     temperature=1.0, seed=7)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens == 12
    assert resp.choices[0].text != resp.choices[1].text  # independent samples


def test_best_of_returns_the_n_most_likely_of_its_samples(client, server):
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, n=1,
                                     best_of=4, temperature=1.0, seed=11, logprobs=0)
    assert len(resp.choices) == 1 and resp.usage.completion_tokens == 6
    wide = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, n=4,
                                     temperature=1.0, seed=11, logprobs=0)
    # The same four samples (same seed); best_of keeps the one of highest cumulative logprob.
    best = max(wide.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert resp.choices[0].text == best.text


def test_same_seed_reproduces_sampled_text_and_another_seed_changes_it(client, server):
    def sample(seed):
        return [c.text for c in client.completions.create(
            model=server.model, prompt=PROMPT, max_tokens=12, temperature=1.0, n=2,
            seed=seed).choices]

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_logprobs_have_openai_shape_and_the_engine_values(client, server, offline_llm):
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5,
                                     temperature=0, logprobs=3)
    ref = offline(offline_llm, PROMPT, max_tokens=5, logprobs=3).outputs[0]
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets
    for pos, token_id, got, top in zip(ref.logprobs, ref.token_ids, lp.token_logprobs,
                                       lp.top_logprobs):
        # 1e-3: the server may reuse cached prefix blocks computed in another batch shape.
        assert got == pytest.approx(pos[token_id].logprob, abs=1e-3)
        # The top 3, plus the chosen token if outside them, keyed by text (OpenAI's format), so
        # tokens that decode alike (e.g. partial UTF-8 bytes) share one entry.
        assert len(top) == len({e.decoded_token for e in pos.values()})
        assert max(top.values()) == pytest.approx(max(e.logprob for e in pos.values()),
                                                  abs=1e-3)


def test_echo_with_logprobs_puts_the_prompt_first_with_a_none_logprob(client, server,
                                                                      offline_llm):
    n_prompt = len(offline_llm.get_tokenizer()(PROMPT).input_ids)
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3,
                                     temperature=0, echo=True, logprobs=1)
    choice = resp.choices[0]
    ref = offline(offline_llm, PROMPT, max_tokens=3).outputs[0].text
    assert choice.text == PROMPT + ref
    lp = choice.logprobs
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[:n_prompt]) == PROMPT
    assert resp.usage.prompt_tokens == n_prompt and resp.usage.completion_tokens == 3


def test_stop_string_is_cut_from_the_text_and_reported(client, server, offline_llm):
    full = offline(offline_llm, PROMPT, max_tokens=16).outputs[0].text
    stop = full[6:9]
    assert len(stop) == 3 and stop in full
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16,
                                     temperature=0, stop=[stop])
    choice = resp.choices[0]
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    kept = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16,
                                     temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[: full.index(stop) + 3]


def test_vllm_extra_sampling_fields_are_honoured(client, server, offline_llm):
    tok_ids = offline(offline_llm, PROMPT, max_tokens=6).outputs[0].token_ids
    resp = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=6, temperature=0,
        extra_body={"stop_token_ids": [tok_ids[2]], "top_k": 5, "min_p": 0.0,
                    "repetition_penalty": 1.0, "ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["stop_reason"] == tok_ids[2]
    assert resp.usage.completion_tokens == 3  # the stop token counts
    x = offline_llm.get_tokenizer().convert_tokens_to_ids("x")
    biased = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3,
                                       temperature=0, logit_bias={str(x): 100})
    assert biased.choices[0].text == "xxx"


def test_stream_joins_to_the_non_streamed_text_with_one_finish_chunk_and_usage(http, server):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    full = http.post("/v1/completions", json=body).json()
    stop = full["choices"][0]["text"][5:8]
    for extra in ({}, {"stop": [stop]}):
        plain_resp = http.post("/v1/completions", json={**body, **extra}).json()
        plain = plain_resp["choices"][0]
        with http.stream("POST", "/v1/completions", json={
            **body, **extra, "stream": True, "stream_options": {"include_usage": True},
        }) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = sse_events(resp.iter_lines())
        assert events[-1] == "[DONE]"
        chunks, usage_chunk = events[:-2], events[-2]
        assert usage_chunk["choices"] == [] and usage_chunk["usage"] == plain_resp["usage"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks
                    if c["choices"][0]["finish_reason"]]
        assert finishes == [plain["finish_reason"]]
        # At most one chunk per engine step: never more chunks than tokens.
        assert len(chunks) <= usage_chunk["usage"]["completion_tokens"]


def test_streamed_n2_with_logprobs_gives_each_choice_its_tokens_once(http, server):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 5, "temperature": 1.0,
            "n": 2, "seed": 3, "logprobs": 2, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    plain = http.post("/v1/completions", json={**body, "stream": False}).json()
    for index in (0, 1):
        mine = [c["choices"][0] for c in events[:-1] if c["choices"][0]["index"] == index]
        assert sum(1 for c in mine if c["finish_reason"]) == 1
        tokens = [t for c in mine for t in c["logprobs"]["tokens"]]
        ref = next(c for c in plain["choices"] if c["index"] == index)
        assert len(tokens) == 5
        assert "".join(c["text"] for c in mine) == ref["text"]
        assert tokens == ref["logprobs"]["tokens"]


def test_use_beam_search_returns_the_engines_beams_best_first(http, server, offline_llm):
    from pagedserve import BeamSearchParams

    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 6, "n": 3,
            "use_beam_search": True, "length_penalty": 0.0, "ignore_eos": True}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    ref = offline_llm.beam_search(PROMPT, BeamSearchParams(beam_width=3, max_tokens=6,
                                                           ignore_eos=True, length_penalty=0.0))
    assert [c["text"] for c in choices] == [s.text for s in ref[0].sequences]
    assert resp.json()["usage"]["completion_tokens"] == 18


@pytest.mark.parametrize("extra,param", [({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"),
                                         ({"temperature": 0.5}, "temperature")])
def test_use_beam_search_rejects_what_it_cannot_honour(http, server, extra, param):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "n": 2,
            "use_beam_search": True, **extra}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
