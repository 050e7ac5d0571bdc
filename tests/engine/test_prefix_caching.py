"""Automatic prefix caching: full blocks reused by later requests, outputs unchanged."""

import pytest

from pagedserve import LLM, SamplingParams
from test_llm_engine import greedy, prompts_of_lengths, run
from utils import ours_as_pairs


def make(checkpoints, **kw):
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM(str(checkpoints("qwen2")), dtype="float32", block_size=4, **kw)


def test_same_prompt_twice_reuses_all_but_the_last_block(checkpoints):
    engine = make(checkpoints).engine
    prompt = prompts_of_lengths([12])[0]  # three full blocks
    engine.add_request("a", None, greedy(3), prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.stats["prompt_tokens"]
    group = engine.add_request("b", None, greedy(3), prompt_token_ids=prompt)
    engine.step()
    # Two cached blocks reused; the last block (with the last token) is recomputed.
    assert engine.stats["prompt_tokens"] - before == 4
    assert group.seqs[0].num_computed_tokens == 12
    assert engine.kv_manager.prefix_hits == 8
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_used_blocks() == 0


def test_shared_prefix_is_reused_while_its_first_holder_still_runs(checkpoints):
    engine = make(checkpoints).engine
    system = prompts_of_lengths([16], seed=1)[0]
    a = engine.add_request("a", None, greedy(20), prompt_token_ids=system + [7, 8, 9])
    engine.step()
    b = engine.add_request("b", None, greedy(20), prompt_token_ids=system + [10, 11])
    engine.step()
    ta = engine.kv_manager.block_table(a.seqs[0].seq_id)
    tb = engine.kv_manager.block_table(b.seqs[0].seq_id)
    assert ta[:4] == tb[:4]
    assert all(engine.kv_manager.pool.ref_counts[x] == 2 for x in ta[:4])
    engine.check_invariants()


@pytest.mark.parametrize("preempt", [False, True])
def test_outputs_are_the_same_with_prefix_caching_on_and_off(checkpoints, preempt):
    shared = prompts_of_lengths([9], seed=4)[0]
    prompts = [shared + p[1:] for p in prompts_of_lengths([3, 8, 5, 12, 1 + 1, 7], seed=6)]
    prompts += prompts[:2]
    kw = dict(num_kv_blocks=16, kv_cache_memory=None, preemption_mode="recompute") if preempt \
        else {}
    off = run(make(checkpoints, enable_prefix_caching=False, **kw), prompts, greedy(16))
    llm = make(checkpoints, **kw)
    run(llm, prompts[:2], greedy(16))  # earlier requests leave their blocks in the cache
    on = run(llm, prompts, greedy(16))
    for a, b in zip(on, off):
        assert ours_as_pairs(a) == ours_as_pairs(b)
    assert llm.engine.kv_manager.prefix_cache_hit_rate() > 0
    if preempt:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.num_used_blocks() == 0
    llm.engine.check_invariants()


def test_prompt_logprobs_request_computes_every_prompt_position(checkpoints):
    llm = make(checkpoints)
    prompt = {"prompt_token_ids": prompts_of_lengths([13])[0]}
    llm.generate(prompt, greedy(2), use_tqdm=False)
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == 13 and all(p for p in out.prompt_logprobs[1:])


def test_evicted_blocks_are_forgotten_by_the_cache(checkpoints):
    engine = make(checkpoints, kv_cache_memory=None, num_kv_blocks=6).engine
    first = prompts_of_lengths([13], seed=1)[0]
    engine.add_request("a", None, greedy(2), prompt_token_ids=first)
    while engine.has_unfinished_requests():
        engine.step()
    for i, p in enumerate(prompts_of_lengths([17, 18], seed=2)):  # reuse every block
        engine.add_request(f"x{i}", None, greedy(2), prompt_token_ids=p)
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.kv_manager.match_prefix(first) == []
