"""The engine end to end on tiny random models: token-exact against HF, really paged, and
unchanged by preemption or by what else is in the batch."""

import math
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from utils import assert_tie_rule, hf_greedy, ours_as_pairs, shuffled_free_blocks

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "opt", "gpt2"]


def prompts_of_lengths(lengths, seed=0):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 500) for _ in range(n - 1)] for n in lengths]


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5, **kw)


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_matches_hf_generate_per_prompt(arch, checkpoints, hf_models):
    llm = LLM(str(checkpoints(arch)), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    prompts = prompts_of_lengths([3, 9, 17, 30])
    outs = run(llm, prompts, greedy())
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(hf_models(arch), prompt, 12)
        assert_tie_rule(ours_as_pairs(out), ref, arch)
        # Logprobs of the agreeing prefix match within 1e-3.
        for ours_pos, (tok, ref_pos) in zip(out.logprobs, zip(ref[0], ref[1])):
            if tok not in ours_pos:
                break
            assert abs(ours_pos[tok].logprob - ref_pos[tok]) < 1e-3
    assert llm.engine.num_used_blocks() == 0


def _run_with_nan_in_free_blocks(llm, prompts, params):
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, params, prompt_token_ids=p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out.outputs[0]
        engine.kv_cache.fill_blocks(engine.kv_manager.pool.free_blocks(), float("nan"))
    return [done[i] for i in range(len(prompts))]


def test_outputs_unchanged_with_shuffled_free_list_and_nan_in_free_blocks(checkpoints):
    path = str(checkpoints("gemma3"))
    prompts = prompts_of_lengths([5, 13, 22, 7, 40])
    ref = run(LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22), prompts, greedy())
    llm = shuffled_free_blocks(LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22), 7)
    outs = _run_with_nan_in_free_blocks(llm, prompts, greedy())
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert llm.engine.num_used_blocks() == 0


def test_sequence_holds_ceil_prompt_blocks_and_gains_one_when_last_fills(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    engine = llm.engine
    group = engine.add_request("a", None, greedy(8), prompt_token_ids=prompts_of_lengths([10])[0])
    seq = group.seqs[0]
    counts = []
    while engine.has_unfinished_requests():
        engine.step()
        counts.append((seq.num_computed_tokens, len(engine.kv_manager.block_table(seq.seq_id))))
    assert counts[0] == (10, math.ceil(10 / 4))
    for computed, blocks in counts[1:-1]:
        assert blocks == math.ceil(computed / 4)


def test_forced_preemption_by_recomputation_gives_unconstrained_outputs_and_empties_the_pool(
    checkpoints,
):
    path = str(checkpoints("qwen3"))
    prompts = prompts_of_lengths([6, 11, 3, 14, 9, 5, 12, 8], seed=3)
    params = greedy(20)
    ref = run(LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22), prompts, params)
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=14,
              preemption_mode="recompute")
    outs = run(llm, prompts, params)
    assert llm.engine.scheduler.preemptions_by_mode["recompute"] > 0
    for a, b in zip(outs, ref):
        assert ours_as_pairs(a) == ours_as_pairs(b)
    assert llm.engine.num_used_blocks() == 0
    llm.engine.check_invariants()


def test_request_alone_equals_request_among_thirty_others(checkpoints):
    llm = LLM(str(checkpoints("opt")), dtype="float32", block_size=8, kv_cache_memory=1 << 23)
    target = prompts_of_lengths([19], seed=11)[0]
    alone = run(llm, [target], greedy(16))[0]
    others = prompts_of_lengths([random.Random(i).randrange(2, 60) for i in range(30)], seed=5)
    crowd = others[:15] + [target] + others[15:]
    among = run(llm, crowd, greedy(16))[15]
    assert ours_as_pairs(among) == ours_as_pairs(alone)


def test_too_long_prompt_is_rejected_alone_and_the_rest_goes_on(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, num_kv_blocks=8,
              max_model_len=64, max_num_batched_tokens=64)
    engine = llm.engine
    engine.add_request("ok", None, greedy(4), prompt_token_ids=[1, 5, 6])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", None, greedy(4), prompt_token_ids=[5] * 65)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("big", None, greedy(4), prompt_token_ids=[5] * 40)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("bad", None, greedy(4), prompt_token_ids=[1, 100000])
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", None, greedy(4), prompt_token_ids=[])
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["ok"] and len(outs[0].outputs[0].token_ids) == 4


def test_request_that_could_not_grow_in_an_empty_cache_is_refused_naming_max_tokens(checkpoints):
    # It used to be admitted and cut short with finish_reason "length" (issue 25).
    llm = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, num_kv_blocks=3)
    with pytest.raises(ValueError, match="max_tokens.*needs 14 KV blocks alone.*has 3"):
        run(llm, [[1, 2, 3, 4, 5, 6, 7]], greedy(50))
    out = run(llm, [[1, 2, 3, 4, 5, 6, 7]], greedy(12 - 7 + 1))[0]  # the most 12 slots hold
    assert out.finish_reason == "length" and len(out.token_ids) == 12 - 7 + 1
    assert llm.engine.num_used_blocks() == 0


def test_budget_below_max_model_len_without_chunked_prefill_is_rejected(checkpoints):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(str(checkpoints("llama")), dtype="float32", max_model_len=256,
            max_num_batched_tokens=128, enable_chunked_prefill=False)


def test_seeded_sampling_is_reproducible_whatever_else_is_in_the_batch(checkpoints):
    llm = LLM(str(checkpoints("gemma3")), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    prompt = prompts_of_lengths([7], seed=1)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=16,
                            ignore_eos=True)
    alone = run(llm, [prompt], seeded)[0].token_ids
    crowd = prompts_of_lengths([4, 9, 15], seed=2)
    mixed = llm.generate(
        [{"prompt_token_ids": p} for p in crowd[:2] + [prompt] + crowd[2:]],
        [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 2 + [seeded]
        + [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)],
        use_tqdm=False,
    )
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = run(llm, [prompt], SamplingParams(temperature=1.0, seed=124, max_tokens=16,
                                                   ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_seeded_sampling_survives_preemption(checkpoints):
    path = str(checkpoints("llama"))
    prompts = prompts_of_lengths([6, 11, 3, 14, 9, 5], seed=4)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(len(prompts))]
    ref = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_prompt_logprobs_match_hf_and_start_with_none(checkpoints, hf_models):
    llm = LLM(str(checkpoints("qwen2")), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    prompt = prompts_of_lengths([10], seed=9)[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    with torch.inference_mode():
        logits = hf_models("qwen2")(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, -1)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        tok = prompt[pos]
        assert abs(entry[tok].logprob - float(ref[pos - 1, tok])) < 1e-3
        assert entry[tok].rank == int((ref[pos - 1] > ref[pos - 1, tok]).sum()) + 1
        assert len(entry) in (3, 4)


def test_logprobs_have_rank_and_decoded_token_and_cumulative_sum(checkpoints):
    llm = LLM(str(checkpoints("gpt2")), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    out = run(llm, prompts_of_lengths([6]), greedy(5))[0]
    assert len(out.logprobs) == 5
    for tok, pos in zip(out.token_ids, out.logprobs):
        assert pos[tok].rank == 1  # greedy
        assert all(isinstance(lp.decoded_token, str) for lp in pos.values())
        assert len(pos) == 5
    assert abs(out.cumulative_logprob - sum(p[t].logprob for t, p in zip(out.token_ids,
                                                                         out.logprobs))) < 1e-4


def test_stop_token_ids_min_tokens_and_max_tokens(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    prompt = prompts_of_lengths([8], seed=2)[0]
    free = run(llm, [prompt], greedy(10))[0].token_ids
    stop_at = free[3]
    out = run(llm, [prompt], greedy(10, stop_token_ids=[stop_at]))[0]
    first = free.index(stop_at)
    assert out.token_ids == free[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    out = run(llm, [prompt], greedy(10, stop_token_ids=[stop_at], min_tokens=first + 2))[0]
    assert len(out.token_ids) > first + 1
    out = run(llm, [prompt], greedy(3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_stop_string_is_cut_from_the_text(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    prompt = prompts_of_lengths([8], seed=2)[0]
    text = run(llm, [prompt], greedy(12))[0].text
    stop = text[4:7]
    assert stop
    out = run(llm, [prompt], greedy(12, stop=[stop]))[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    out = run(llm, [prompt], greedy(12, stop=[stop], include_stop_str_in_output=True))[0]
    assert out.text == text[: text.index(stop) + len(stop)]


def test_n_returns_n_outputs_and_string_prompts_work(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    outs = llm.generate(["Return a value", "The"], SamplingParams(n=3, temperature=1.0, seed=0,
                                                                  max_tokens=6), use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert outs[0].prompt == "Return a value"
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    assert llm.engine.num_used_blocks() == 0


def test_invalid_sampling_params_and_prompts_raise_value_errors(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("x", SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([None], use_tqdm=False)  # (a bare list of token ids is a prompt: vLLM's)
    assert not llm.engine.has_unfinished_requests()


def test_unknown_engine_option_is_a_value_error(checkpoints):
    with pytest.raises(ValueError, match="bogus"):
        LLM(str(checkpoints("llama")), bogus=1)
