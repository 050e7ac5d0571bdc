"""Speculative decoding through the real engine (tiny float32 Llama): n-gram and draft-model
speculation leave every output exactly as it is without speculation -- greedy and seeded sampled
tokens, logprobs, finish reasons -- under n > 1, stop strings, stop token ids, min_tokens,
penalties, max_tokens, chunked prefill, prefix caching and preemption (swap and recompute); no
block leaks; beam search is refused. A model drafting for itself has every greedy draft accepted
(its paged cache follows the target's through swaps, recomputation and the prefix cache); a
draft of another vocabulary or tokenizer, or under tensor parallelism, is refused."""

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
    """`reqs` on `llm`'s engine with `cache`; `spec`: True (SPEC), a speculative_config, or
    False (off)."""
    engine = llm.engine
    engine.reconfigure_cache(**cache)
    config = SPEC if spec is True else spec
    engine.spec = SpecDecoder(SpeculativeConfig.parse(config)) if config else None
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


# --- draft-model speculation -----------------------------------------------------------------


@pytest.fixture(scope="module")
def drafts(checkpoints, tmp_path_factory):
    """The draft checkpoints: "small" (1 layer, other random weights: drafts mostly rejected)
    and "self" (the target itself: drafts accepted)."""
    import tiny

    small = tiny.make_checkpoint(tmp_path_factory.mktemp("draft"), "llama", seed=1,
                                 num_hidden_layers=1)
    return {"small": str(small), "self": str(checkpoints("llama"))}


_DRAFT_LLMS: dict[str, LLM] = {}


def draft_llm(checkpoints, drafts, name):
    """An engine speculating with draft `name` (the public option), once per module."""
    if name not in _DRAFT_LLMS:
        _DRAFT_LLMS[name] = LLM(str(checkpoints("llama")), dtype="float32", block_size=4,
                                max_model_len=128, speculative_config=draft_spec(drafts, name))
    return _DRAFT_LLMS[name]


def draft_spec(drafts, name, k=3):
    return {"model": drafts[name], "num_speculative_tokens": k}


def test_the_public_option_builds_the_draft_model_speculator(checkpoints, drafts):
    llm = draft_llm(checkpoints, drafts, "small")
    spec = llm.engine.spec
    assert (spec.config.method, spec.config.model) == ("draft_model", drafts["small"])
    drafter = llm.engine.executor.runner.drafter
    assert drafter is not None and len(drafter.kv_cache.layers) == 1
    # its cache has the target's blocks, and the budget paid for both
    assert drafter.kv_cache.num_blocks == llm.engine.num_kv_blocks


@pytest.mark.parametrize("name,cache", [("small", c) for c in CACHES] + [
    ("self", "swap"), pytest.param("self", "chunked prefix-cached", marks=pytest.mark.slow),
    pytest.param("self", "recompute", marks=pytest.mark.slow)])
def test_outputs_with_draft_model_speculation_equal_the_outputs_without_exactly(
        llm, checkpoints, drafts, name, cache):
    target = draft_llm(checkpoints, drafts, name)
    drafted = preempted = 0
    for seed in range(2):
        reqs = workload(seed)
        want = reference(llm, seed)  # the n-gram engine's, speculation off: the same target
        got, spec = run(target, reqs, draft_spec(drafts, name), **CACHES[cache])
        for (rid, _, params), a, b in zip(reqs, got, want):
            assert a == b, f"request {rid} ({params}) differs with draft {name}"
        drafted += spec.num_draft_tokens
        preempted += target.engine.scheduler.num_preemptions  # (a scheduler per run)
    assert drafted > 0  # (acceptance: see the greedy test below)
    if cache in ("swap", "recompute") and name == "small":
        assert preempted > 0  # (a model drafting for itself preempts in the greedy test below)


def greedy_workload(seed):
    """Plain greedy requests (no penalties, no min_tokens): the target's argmax is the raw one,
    which a model drafting for itself proposes."""
    rng = random.Random(seed)
    return [(f"g{seed}-{i}", [rng.randrange(3, 500) for _ in range(rng.randint(8, 30))],
             SamplingParams(temperature=0.0, max_tokens=rng.randint(12, 24), ignore_eos=True,
                            logprobs=rng.choice([None, 1])))
            for i in range(rng.randint(4, 5))]


@pytest.mark.parametrize("cache", [pytest.param("roomy", marks=pytest.mark.slow),
                                   "chunked prefix-cached", "swap", "recompute"])
def test_a_model_drafting_for_itself_has_every_greedy_draft_accepted(checkpoints, drafts, cache):
    # Pins the draft cache: a swapped, copied, recomputed or prefix-cached position whose draft
    # K/V were missing or stale would make the draft propose other tokens than the target's.
    target = draft_llm(checkpoints, drafts, "self")
    preempted = 0
    for seed in range(2):
        _, spec = run(target, greedy_workload(seed), draft_spec(drafts, "self"), **CACHES[cache])
        assert spec.num_draft_tokens > 0
        assert spec.num_accepted_tokens == spec.num_draft_tokens, spec.summary()
        preempted += target.engine.scheduler.num_preemptions
    if cache in ("swap", "recompute"):
        assert preempted > 0


def test_a_prefix_cache_hit_brings_the_draft_cache_along(checkpoints, drafts):
    # B's prompt starts with A's: B's first blocks come from the prefix cache, and the draft
    # reads its K/V from them (nothing recomputes them). With the draft cache wiped in between,
    # B's drafts go wrong (its outputs stay exact): the cached blocks' draft K/V were used.
    target = draft_llm(checkpoints, drafts, "self")
    engine = target.engine
    rng = random.Random(5)
    prefix = [rng.randrange(3, 500) for _ in range(40)]
    a = [("a", prefix + [7, 8], SamplingParams(temperature=0.0, max_tokens=2))]
    b = [("b", prefix + [9, 10, 11], SamplingParams(temperature=0.0, max_tokens=16,
                                                    ignore_eos=True))]
    cache = dict(num_kv_blocks=256, enable_prefix_caching=True, num_cpu_blocks=0)
    results = []
    for wipe in (False, True):
        run(target, a, draft_spec(drafts, "self"), **cache)
        if wipe:
            draft_cache = engine.executor.runner.drafter.kv_cache
            draft_cache.fill_blocks(list(range(draft_cache.num_blocks)), 0.0)
        engine.spec = SpecDecoder(SpeculativeConfig.parse(draft_spec(drafts, "self")))
        for rid, prompt, params in b:
            engine.add_request(rid, None, params, prompt_token_ids=prompt)
        out = drive(engine, 500)["b"]
        assert out.num_cached_tokens >= 32
        results.append((output_key(out), engine.spec.num_accepted_tokens,
                        engine.spec.num_draft_tokens))
    (key, accepted, drafted), (wiped_key, wiped_accepted, _) = results
    assert accepted == drafted > 0
    assert wiped_key == key and wiped_accepted < accepted


def test_draft_model_sampling_follows_the_target_distribution(checkpoints, drafts):
    # The token after the first, drawn in a speculative row (the small draft's point-mass draft
    # verified), over many seeds, against the target's top-k distribution at that position
    # (its raw logprobs from a run without speculation).
    from scipy.stats import chisquare

    target = draft_llm(checkpoints, drafts, "small")
    engine = target.engine
    prompt = [7, 45, 300, 12, 99]
    params = dict(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    reqs = [(f"c{s}", prompt, SamplingParams(seed=s, **params)) for s in range(5000, 5800)]
    outs, spec = run(target, reqs, draft_spec(drafts, "small", k=1), num_kv_blocks=4096,
                     enable_prefix_caching=True, num_cpu_blocks=0)
    assert spec.num_drafts > 700
    tokens_of = [o[0][0][0] for o in outs]  # output_key: the first completion's token ids
    firsts = [t[0] for t in tokens_of]
    first = max(set(firsts), key=firsts.count)
    seconds = [t[1] for t in tokens_of if t[0] == first]
    engine.spec = None
    ref = target.generate([{"prompt_token_ids": prompt + [first]}],
                          SamplingParams(temperature=0.0, max_tokens=1, logprobs=3),
                          use_tqdm=False)[0].outputs[0].logprobs[0]
    tokens = sorted(ref)
    import math

    weights = [math.exp(ref[t].logprob) for t in tokens]
    expected = [w / sum(weights) * len(seconds) for w in weights]
    assert set(seconds) <= set(tokens), "a token outside the top-k was emitted"
    _, p_value = chisquare([seconds.count(t) for t in tokens], expected)
    assert len(seconds) > 300
    assert p_value > 1e-3, ([seconds.count(t) for t in tokens], expected)


def test_beam_search_with_a_draft_model_is_refused(checkpoints, drafts):
    target = draft_llm(checkpoints, drafts, "small")
    target.engine.spec = SpecDecoder(SpeculativeConfig.parse(draft_spec(drafts, "small")))
    with pytest.raises(ValueError, match="use_beam_search.*speculative"):
        target.engine.add_request("b", None, SamplingParams(n=2, use_beam_search=True,
                                                            temperature=0.0, max_tokens=4),
                                  prompt_token_ids=[5, 6, 7])


def test_a_draft_model_of_another_vocabulary_is_refused(checkpoints, tmp_path):
    import tiny

    import json

    other = tiny.make_checkpoint(tmp_path / "v", "llama", num_hidden_layers=1, vocab_size=256)
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary of 256"):
        LLM(str(checkpoints("llama")), dtype="float32",  # the JSON of `serve`'s flag
            speculative_config=json.dumps({"model": str(other), "num_speculative_tokens": 2}))


def test_a_draft_model_with_another_tokenizer_is_refused(checkpoints, tmp_path):
    import json

    import tiny

    other = tiny.make_checkpoint(tmp_path / "t", "llama", num_hidden_layers=1)
    path = other / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens swap ids: the same size, not the same
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="speculative_config.model.*another tokenizer"):
        LLM(str(checkpoints("llama")), dtype="float32",
            speculative_config={"model": str(other), "num_speculative_tokens": 2})


def test_a_draft_model_under_tensor_parallelism_is_refused(checkpoints, drafts):
    with pytest.raises(ValueError, match="speculative_config.model.*tensor_parallel_size=1"):
        LLM(str(checkpoints("llama")), dtype="float32", tensor_parallel_size=2,
            speculative_config=draft_spec(drafts, "small"))


# --- structured outputs ------------------------------------------------------------------------


def structured_workload(tokenizer):
    from pagedserve.structured_output import StructuredOutputsParams as SO

    colors = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 10}
    constraints = [SO(regex=r"(ab|cd |abc)+"), SO(json=colors, disable_any_whitespace=True),
                   SO(grammar='root ::= "[" term (" + " term)* "]"\nterm ::= [0-9]')]
    prompts = ['["red","green","red","green","blue","red"', "ab cd ab cd abc ab cd",
               "[1 + 2 + 1 + 2 + 1"]
    reqs = []
    for i, so in enumerate(constraints):
        for j, prompt in enumerate(prompts):
            ids = list(tokenizer(prompt).input_ids)
            kw = dict(max_tokens=24, structured_outputs=so, logprobs=1)
            reqs.append((f"s{i}{j}g", ids, SamplingParams(temperature=0.0, **kw)))
            reqs.append((f"s{i}{j}r", ids, SamplingParams(temperature=0.8, seed=7 * i + j, n=2,
                                                           **kw)))
    return reqs


@pytest.mark.parametrize("cache", ["roomy", pytest.param("swap", marks=pytest.mark.slow)])
def test_structured_outputs_with_ngram_speculation_equal_the_outputs_without_exactly(
        llm, cache, monkeypatch):
    engine = llm.engine
    reqs = structured_workload(llm.get_tokenizer())
    want, _ = run(llm, reqs, spec=False, **CACHES[cache])
    cut = []
    real = engine.structured.valid_drafts

    def spy(group, seq, drafts):
        kept = real(group, seq, drafts)
        cut.append(len(kept) < len(drafts))
        return kept

    monkeypatch.setattr(engine.structured, "valid_drafts", spy)
    got, spec = run(llm, reqs, spec=True, **CACHES[cache])
    for (rid, _, _), a, b in zip(reqs, got, want):
        assert a == b, f"request {rid} differs with speculation"
    assert spec.num_accepted_tokens > 0  # constrained rows speculated, and drafts were accepted
    assert any(cut)  # and the grammar refused some drafts before they were verified


def test_the_grammar_keeps_the_drafts_up_to_the_first_it_refuses(llm):
    from pagedserve.structured_output import StructuredOutputsParams as SO
    from pagedserve.structured_output.manager import GRAMMAR_KEY

    engine = llm.engine
    tok = llm.get_tokenizer()
    engine.spec = None
    engine.add_request("v", None, SamplingParams(max_tokens=4, structured_outputs=SO(
        regex=r"ab(ab)*")), prompt_token_ids=[5, 6])
    group = engine.groups["v"]
    seq = group.seqs[0]
    matcher = group.extra[GRAMMAR_KEY][seq.seq_id]
    a, b, z = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "z"))
    structured = engine.structured
    assert structured.valid_drafts(group, seq, [a, b, a, z, b]) == [a, b, a]
    assert structured.valid_drafts(group, seq, [z, a]) == []
    assert matcher.accept_token(a)  # the matcher was left at its start
    engine.abort_request("v")
    assert engine.num_used_blocks() == 0


@pytest.mark.slow
def test_the_embedded_model_drafting_for_itself_gives_the_same_greedy_tokens_and_logprobs():
    from pagedserve.models.embedded import embedded_model_path

    prompt = ("<start_of_turn>user\nHere is a passage:\n\nThe quick brown fox jumps over the lazy "
              "dog. The dog sleeps.\n\nWrite the passage above again, exactly as it is."
              "<end_of_turn>\n<start_of_turn>model\n")
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True)
    llm = LLM("gemma-3-270m", dtype="float32", kv_cache_memory=256 << 20, speculative_config={
        "model": str(embedded_model_path()), "num_speculative_tokens": 4})
    engine = llm.engine
    spec, engine.spec = engine.spec, None
    want = output_key(llm.generate([prompt], params, use_tqdm=False)[0])
    engine.spec = spec
    got = output_key(llm.generate([prompt], params, use_tqdm=False)[0])
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0  # its own greedy drafts
    assert got == want
    assert engine.num_used_blocks() == 0
