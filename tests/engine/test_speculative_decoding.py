"""Speculative decoding through the real engine (tiny float32 Llama): n-gram speculation leaves
every output exactly as it is without speculation -- greedy and seeded sampled tokens, logprobs,
finish reasons -- under n > 1, stop strings, stop token ids, min_tokens, penalties, max_tokens,
chunked prefill, prefix caching and preemption (swap and recompute); no block leaks; beam search
is refused."""

import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.core.spec_decode import SpecDecoder, SpeculativeConfig
from utils import drive, output_key

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def llm(checkpoints):
    """One engine with speculation on (the public option); tests switch `engine.spec` off for
    their reference runs, on the same model and cache."""
    return LLM(str(checkpoints("llama")), dtype="float32", block_size=4, max_model_len=128,
               speculative_config=SPEC)


def workload(seed, sampled=True):
    rng = random.Random(seed)
    reqs = []
    for i in range(rng.randint(2, 4)):
        base = [rng.randrange(3, 500) for _ in range(rng.randint(2, 6))]
        prompt = (base * 8)[: rng.randint(4, 30)]  # repeats: the n-gram proposer finds them
        kw = dict(max_tokens=rng.randint(1, 28), ignore_eos=rng.random() < 0.7,
                  logprobs=rng.choice([None, 0, 2]))
        if sampled and rng.random() < 0.5:
            kw.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(2**31),
                      top_k=rng.choice([0, 20]), n=rng.choice([1, 1, 2, 3]))
        else:
            kw.update(temperature=0.0)
        if rng.random() < 0.3:
            kw["stop"] = rng.sample(["e", "a", "th", " ", "in"], 1)
        if rng.random() < 0.2:
            kw["stop_token_ids"] = [rng.randrange(3, 500)]
        if rng.random() < 0.3:
            kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
        if rng.random() < 0.2:
            kw["repetition_penalty"] = 1.3
        if rng.random() < 0.2:
            kw["frequency_penalty"] = 0.5
        reqs.append((f"{seed}-{i}", prompt, SamplingParams(**kw)))
    return reqs


def run(llm, reqs, spec, **cache):
    engine = llm.engine
    engine.reconfigure_cache(**cache)
    engine.spec = SpecDecoder(SpeculativeConfig.parse(SPEC)) if spec else None
    for rid, prompt, params in reqs:
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    final = drive(engine, 5000)  # checks invariants every step, and that the pool ends empty
    return [output_key(final[rid]) for rid, _, _ in reqs], engine.spec


CACHES = {
    "roomy": dict(num_kv_blocks=512, enable_prefix_caching=False, num_cpu_blocks=0),
    "chunked prefix-cached": dict(num_kv_blocks=512, max_num_batched_tokens=7,
                                  enable_prefix_caching=True, num_cpu_blocks=0),
    "swap": dict(num_kv_blocks=16, preemption_mode="swap", num_cpu_blocks=256,
                 enable_prefix_caching=True),
    "recompute": dict(num_kv_blocks=16, preemption_mode="recompute",
                      enable_prefix_caching=False, num_cpu_blocks=0),
}


_REFERENCE: dict[int, list] = {}


def reference(llm, seed):
    """The outputs of `workload(seed)` without speculation, on a roomy cache (once per seed)."""
    if seed not in _REFERENCE:
        _REFERENCE[seed] = run(llm, workload(seed), spec=False, **CACHES["roomy"])[0]
    return _REFERENCE[seed]


def test_the_public_option_builds_the_ngram_speculator(llm):
    spec = llm.engine.spec
    assert isinstance(spec, SpecDecoder)
    assert (spec.config.method, spec.config.num_speculative_tokens) == ("ngram", 3)


@pytest.mark.parametrize("cache", list(CACHES))
def test_outputs_with_ngram_speculation_equal_the_outputs_without_exactly(llm, cache):
    accepted = 0
    preempted = llm.engine.scheduler.num_preemptions if cache in ("swap", "recompute") else 0
    for seed in range(4):
        reqs = workload(seed)
        want = reference(llm, seed)
        got, spec = run(llm, reqs, spec=True, **CACHES[cache])
        for (rid, _, params), a, b in zip(reqs, got, want):
            assert a == b, f"request {rid} ({params}) differs with speculation"
        accepted += spec.num_accepted_tokens
        preempted += llm.engine.scheduler.num_preemptions
    assert accepted > 0  # drafts were accepted, not merely all rejected
    if cache in ("swap", "recompute"):
        assert preempted > 0


def test_beam_search_with_speculative_config_is_refused(llm):
    with pytest.raises(ValueError, match="use_beam_search.*speculative"):
        llm.engine.add_request("b", None, SamplingParams(n=2, use_beam_search=True,
                                                         temperature=0.0, max_tokens=4),
                               prompt_token_ids=[5, 6, 7])


def test_the_embedded_model_gives_the_same_greedy_tokens_and_logprobs_with_speculation(
        embedded_llm):
    # float32 (the session fixture), a prompt whose answer quotes it: drafts are accepted.
    engine = embedded_llm.engine
    prompt = ("<start_of_turn>user\nHere is a passage:\n\nThe quick brown fox jumps over the lazy "
              "dog. The dog sleeps.\n\nWrite the passage above again, exactly as it is."
              "<end_of_turn>\n<start_of_turn>model\n")
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)
    try:
        engine.spec = None
        want = output_key(embedded_llm.generate([prompt], params, use_tqdm=False)[0])
        engine.spec = SpecDecoder(SpeculativeConfig.parse(SPEC))
        got = output_key(embedded_llm.generate([prompt], params, use_tqdm=False)[0])
        assert engine.spec.num_accepted_tokens > 0
    finally:
        engine.spec = None
    assert got == want
