"""Parallel sampling and best_of share the prompt's blocks (prefilled once, copy-on-write)."""

from pagedserve import LLM, SamplingParams
from test_llm_engine import greedy, prompts_of_lengths, run


def make(checkpoints, **kw):
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM(str(checkpoints("llama")), dtype="float32", block_size=4, **kw)


def test_prompt_is_prefilled_once_and_its_blocks_are_shared_by_all_samples(checkpoints):
    engine = make(checkpoints).engine
    prompt = prompts_of_lengths([10])[0]
    group = engine.add_request("a", None, SamplingParams(n=3, temperature=1.0, seed=0,
                                                         max_tokens=8, ignore_eos=True),
                               prompt_token_ids=prompt)
    engine.step()
    assert engine.stats["prompt_tokens"] == 10  # not 30
    tables = [engine.kv_manager.block_table(s.seq_id) for s in group.seqs]
    assert tables[0] == tables[1] == tables[2]
    assert all(engine.kv_manager.pool.ref_counts[b] == 3 for b in tables[0])
    engine.step()  # each writes position 10 into the shared partial block: two copies, one in place
    tables = [engine.kv_manager.block_table(s.seq_id) for s in group.seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    assert all(engine.kv_manager.pool.ref_counts[b] == 3 for b in tables[0][:2])
    engine.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_used_blocks() == 0


def test_copy_on_write_keeps_every_sample_exact(checkpoints):
    llm = make(checkpoints)
    prompts = prompts_of_lengths([10, 7, 13], seed=5)
    ref = run(llm, prompts, greedy(12))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(n=4, temperature=1.0, top_k=1, max_tokens=12,
                                       ignore_eos=True), use_tqdm=False)
    for r, o in zip(ref, outs):
        assert [c.token_ids for c in o.outputs] == [r.token_ids] * 4
    assert llm.engine.num_used_blocks() == 0


def test_seeded_samples_differ_from_each_other_and_the_set_is_reproducible(checkpoints):
    llm = make(checkpoints)
    prompt = {"prompt_token_ids": prompts_of_lengths([9])[0]}
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    a = [c.token_ids for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs]
    b = [c.token_ids for c in llm.generate(prompt, params, use_tqdm=False)[0].outputs]
    assert a == b and len({tuple(x) for x in a}) == 3


def test_seeded_samples_survive_preemption(checkpoints):
    prompts = [{"prompt_token_ids": p} for p in prompts_of_lengths([9, 14, 6, 11], seed=8)]
    params = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(4)]
    ref = make(checkpoints).generate(prompts, params, use_tqdm=False)
    for mode in ("recompute", "swap"):
        llm = make(checkpoints, kv_cache_memory=None, num_kv_blocks=14, preemption_mode=mode,
                   num_cpu_blocks=64)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0, mode
        assert ([[c.token_ids for c in o.outputs] for o in outs]
                == [[c.token_ids for c in o.outputs] for o in ref]), mode
        assert llm.engine.num_used_blocks() == 0


def test_best_of_returns_the_n_samples_with_the_highest_cumulative_logprob(checkpoints):
    llm = make(checkpoints)
    prompt = {"prompt_token_ids": prompts_of_lengths([9])[0]}
    every = llm.generate(prompt, SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=8,
                                                ignore_eos=True, logprobs=0),
                         use_tqdm=False)[0].outputs
    best = llm.generate(prompt, SamplingParams(n=2, best_of=5, temperature=1.0, seed=3,
                                               max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    for b, r in zip(best, ranked):
        assert abs(b.cumulative_logprob - r.cumulative_logprob) < 1e-3
