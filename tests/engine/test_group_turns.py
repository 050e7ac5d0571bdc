"""Groups whose sequences fit the KV pool one at a time but not all together: every sequence
completes exactly as on a roomy cache (the group runs its sequences in turns), and a request is
rejected at admission only when one of its sequences alone cannot fit the pool."""

import pytest

from pagedserve import LLM, BeamSearchParams, SamplingParams
from test_llm_engine import prompts_of_lengths
from utils import assert_same_outputs, drive, run_requests

ROOMY = dict(kv_cache_memory=1 << 24)


_run = run_requests


@pytest.mark.parametrize("mode,n,blocks,cpu", [("swap", 8, 30, 8), ("recompute", 5, 50, 0)])
def test_wide_groups_on_a_tight_pool_return_every_token_of_a_roomy_run(mode, n, blocks, cpu,
                                                                      checkpoints):
    # Issue 25's case: n samples of 40 tokens on three 6-token prompts came back cut to 10-15
    # tokens with finish_reason "length" and no error.
    path = str(checkpoints("llama"))
    prompts = prompts_of_lengths([6, 6, 6], seed=1)
    requests = [(str(i), p, SamplingParams(n=n, temperature=1.0, seed=i, max_tokens=40,
                                            ignore_eos=True, logprobs=1))
                for i, p in enumerate(prompts)]
    ref, _ = _run(path, requests, **ROOMY)
    outs, engine = _run(path, requests, block_size=4, num_kv_blocks=blocks,
                        preemption_mode=mode, num_cpu_blocks=cpu)
    for out in outs:
        assert [len(c.token_ids) for c in out.outputs] == [40] * n
        assert {c.finish_reason for c in out.outputs} == {"length"}
    assert_same_outputs(outs, ref)
    assert engine.kv_manager.pool.num_used == 0


def test_group_wider_than_the_pool_alone_runs_its_sequences_in_turns(checkpoints):
    # One request whose 6 sequences cannot all hold their 30 tokens at once (6 x 8 blocks > 20),
    # each alone needs 8: it completes, as on a roomy cache, with prefix caching on and off.
    path = str(checkpoints("llama"))
    prompt = prompts_of_lengths([10], seed=2)[0]
    params = SamplingParams(n=6, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True,
                            logprobs=2)
    ref, _ = _run(path, [("a", prompt, params)], **ROOMY)
    for prefix in (False, True):
        outs, engine = _run(path, [("a", prompt, params)], block_size=4, num_kv_blocks=10,
                            enable_prefix_caching=prefix, preemption_mode="recompute",
                            max_num_batched_tokens=16)
        assert_same_outputs(outs, ref)
        assert engine.scheduler.num_turns > 0


def test_beam_search_wider_than_the_pool_returns_the_roomy_beams(checkpoints):
    path = str(checkpoints("llama"))
    prompt = prompts_of_lengths([9], seed=4)[0]
    params = BeamSearchParams(beam_width=4, max_tokens=18, ignore_eos=True)
    ref, _ = _run(path, [("b", prompt, params)], **ROOMY)
    outs, engine = _run(path, [("b", prompt, params)], block_size=4, num_kv_blocks=9,
                        preemption_mode="swap", num_cpu_blocks=4)
    assert [(c.token_ids, c.cumulative_logprob) for c in outs[0].outputs] == \
        [(c.token_ids, c.cumulative_logprob) for c in ref[0].outputs]
    assert engine.scheduler.num_turns > 0


def test_request_is_rejected_only_when_one_sequence_alone_cannot_fit_the_pool(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, num_kv_blocks=10)
    engine = llm.engine
    prompt = prompts_of_lengths([6], seed=0)[0]
    # 6 + 35 tokens: the last sampled token is never computed, 40 slots = 10 blocks: it fits
    # (8 sequences of it take turns); one token more needs 11 blocks alone.
    engine.add_request("fits", None, SamplingParams(n=8, max_tokens=35, ignore_eos=True),
                       prompt_token_ids=prompt)
    with pytest.raises(ValueError, match="max_tokens.*11 KV blocks.*10"):
        engine.add_request("big", None, SamplingParams(max_tokens=36), prompt_token_ids=prompt)
    assert list(engine.groups) == ["fits"]
    final = drive(engine, 5000)
    assert [len(c.token_ids) for c in final["fits"].outputs] == [35] * 8
