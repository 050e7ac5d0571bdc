"""vLLM's per-request extras in the engine: the chosen token first in each logprobs dict,
logprobs -1 (the whole vocabulary), allowed_token_ids, bad_words, and cache_salt isolating
prefix-cache hits (with each request's cached prompt tokens reported)."""

import pytest

from pagedserve import LLM, SamplingParams

PROMPT = "The module provides"


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints("llama")), dtype="float32", block_size=4, max_logprobs=-1)


def test_each_logprobs_dict_lists_the_chosen_token_first(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                                                logprobs=2, prompt_logprobs=2),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    for token, pos in zip(comp.token_ids, comp.logprobs):
        assert next(iter(pos)) == token and len(pos) in (2, 3)
        ranks = [e.rank for e in list(pos.values())[1:]]
        assert ranks == sorted(ranks)
    for token, pos in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert next(iter(pos)) == token


def test_logprobs_minus_1_is_the_whole_vocabulary_only_with_max_logprobs_minus_1(
        llm, checkpoints):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0, logprobs=-1),
                       use_tqdm=False)[0]
    vocab = llm.engine.vocab_size
    assert [len(pos) for pos in out.outputs[0].logprobs] == [vocab, vocab]
    limited = LLM(str(checkpoints("llama")), dtype="float32")
    with pytest.raises(ValueError, match="logprobs=-1"):
        limited.generate([PROMPT], SamplingParams(logprobs=-1), use_tqdm=False)


def test_allowed_token_ids_and_bad_words_constrain_the_output(llm):
    tok = llm.get_tokenizer()
    free = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0,
                                                 ignore_eos=True), use_tqdm=False)[0]
    ids = free.outputs[0].token_ids
    word = tok.decode(ids[:1])
    banned = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0,
                                                   ignore_eos=True, bad_words=[word]),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert ids[0] not in banned
    allowed = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.0, seed=1,
                                                    allowed_token_ids=[10, 20, 30]),
                           use_tqdm=False)[0].outputs[0].token_ids
    assert set(allowed) <= {10, 20, 30}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate([PROMPT], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)


def test_cache_salt_isolates_prefix_hits_and_outputs_report_cached_tokens(llm):
    prompt = "word " * 12
    greedy = dict(max_tokens=2, temperature=0)

    def run(salt):
        out = llm.generate([prompt], SamplingParams(**greedy, cache_salt=salt),
                           use_tqdm=False)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first, ids = run("a")
    again, ids_again = run("a")
    other, _ = run("b")
    plain, ids_plain = run(None)
    assert first == 0 and again >= 8 and other == 0 and plain == 0
    assert ids == ids_again == ids_plain  # same answer whatever the cache held
