"""Hybrid families with recurrent layers (Gated DeltaNet: Qwen3-Next, Qwen3.5; Mamba 2: Granite
4.0-H) in the engine. Their state lives in cache entries, one block per sequence
(layers/recurrent_state.py): greedy equal to HF's generate (tie rule), and runs that move it
around -- chunked prefill, preemption by swap and by recomputation, copy-on-write forks of beam
search and parallel sampling -- give exactly the roomy run's tokens and logprobs, with the pool
empty at the end. Prefix caching starts a later prompt from a snapshot of the state
(core/state_snapshots.py), exactly as a cold run. N-gram speculation keeps the state a row starts
from and rolls back to it when a draft is rejected (core/state_rollback.py): outputs exactly those
without speculation, under preemption and prefix caching too; a draft model is refused."""

import pytest

from pagedserve import LLM, BeamSearchParams, SamplingParams
from spec_oracle import SPEC, speculating
from test_llm_engine import greedy, prompts_of_lengths
from tiny import RECURRENT_FAMILIES
from utils import (assert_same_outputs, assert_tie_rule, families, hf_greedy, ours_as_pairs,
                   run_requests)

BASE = prompts_of_lengths([9], seed=23)[0]
PROMPTS = prompts_of_lengths([6, 17, 5, 13], seed=23) + [BASE + [7, 8, 9], BASE + [10, 11]]


def _requests():
    reqs = [(f"g{i}", p, greedy(14)) for i, p in enumerate(PROMPTS)]
    reqs.append(("beam", PROMPTS[1], BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)))
    # two samples of one prompt, seeded: a fork after the prompt, each its own state from then on
    reqs.append(("n2", PROMPTS[3], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12,
                                                  ignore_eos=True, logprobs=2)))
    return reqs


def _state_blocks(engine) -> int:
    """Blocks one sequence's state takes (its state columns: one block each)."""
    return len(engine.kv_layout.state_columns())


@pytest.mark.parametrize("arch", RECURRENT_FAMILIES)
def test_family_matches_hf_and_stays_exact_when_its_state_moves(arch, checkpoints, hf_models):
    path = str(checkpoints(arch))
    ref, engine = run_requests(path, _requests(), 2000, block_size=4, kv_cache_memory=1 << 24,
                               enable_chunked_prefill=False)
    assert _state_blocks(engine) > 0
    for i in (0, 1):
        assert_tie_rule(ours_as_pairs(ref[i].outputs[0]), hf_greedy(hf_models(arch), PROMPTS[i], 14),
                        f"{arch} prompt {i} vs HF")
    # room for about three sequences' states and their attention blocks (a pure state-space
    # model has none): swaps and recomputes
    attention = len(engine.kv_layout.state_columns()) < engine.kv_layout.width
    states = _state_blocks(engine)
    # (a pure state-space model: four states on the device, one in the CPU pool)
    blocks = 3 * states + 14 if attention else 4 * states
    outs, engine = run_requests(path, _requests(), 6000, block_size=4, num_kv_blocks=blocks,
                                num_cpu_blocks=blocks // 2 if attention else states,
                                preemption_mode="auto",
                                max_num_batched_tokens=8, enable_prefix_caching=True)
    sched = engine.scheduler
    assert sched.preemptions_by_mode["swap"] > 0 and sched.preemptions_by_mode["recompute"] > 0
    assert_same_outputs(outs, ref)


@pytest.mark.parametrize("arch", RECURRENT_FAMILIES)
def test_a_follow_up_turn_starts_from_a_state_snapshot_exactly_as_a_cold_run(arch, checkpoints):
    path = str(checkpoints(arch))
    first = prompts_of_lengths([23], seed=31)[0]
    opts = dict(dtype="float32", block_size=4, kv_cache_memory=1 << 24, max_num_batched_tokens=16)
    llm = LLM(path, enable_prefix_caching=True, **opts)
    kv = llm.engine.kv_manager
    answer = llm.generate([{"prompt_token_ids": first}], greedy(9), use_tqdm=False)[0].outputs[0]
    assert kv.prefix_hits == 0
    # the next turn (the answer and more; its 31 computed tokens: snapshots every 4 decode
    # tokens, the last at 28), the same prompt again (its last full block's snapshot: 20, where
    # the first chunk of 16 was cut), and one sharing 14 tokens (no snapshot inside: cold)
    later = [first + list(answer.token_ids) + [5, 6, 7], first, first[:14] + [9, 9]]
    got = llm.generate([{"prompt_token_ids": p} for p in later], greedy(8), use_tqdm=False)
    assert kv.prefix_hits == 28 + 20
    cold = LLM(path, enable_prefix_caching=False, **opts)
    want = cold.generate([{"prompt_token_ids": p} for p in later], greedy(8), use_tqdm=False)
    assert_same_outputs(got, want)
    assert kv.pool.num_used == 0
    kv.check_invariants()


def _spec_requests():
    """Greedy requests with logprobs, and seeded sampling of two samples."""
    reqs = [(f"s{i}", p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                        logprobs=2)) for i, p in enumerate(PROMPTS[:4])]
    reqs.append(("n2", PROMPTS[1], SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=12,
                                                  ignore_eos=True, logprobs=1)))
    return reqs


def _speculating(path, want, **options):
    return speculating(path, _spec_requests(), want, **options)


# one family per recurrence by default: Gated DeltaNet, KDA, Mamba 1 (pure, hybrid), Mamba 2 (pure,
# hybrid); every one with PAGEDSERVE_EVERY_FAMILY=1
SPEC_FAMILIES = families(["qwen3_5", "kimi_linear", "mamba", "jamba", "mamba2", "granitemoehybrid"],
                         RECURRENT_FAMILIES)


@pytest.mark.parametrize("arch", SPEC_FAMILIES)
def test_speculation_rolls_the_state_back_on_a_rejected_draft_and_stays_exact(arch, checkpoints):
    path = str(checkpoints(arch))
    want, _ = run_requests(path, _spec_requests(), 4000, block_size=4, kv_cache_memory=1 << 24)
    got, engine = _speculating(path, want, kv_cache_memory=1 << 24)
    spec = engine.spec
    # drafts accepted (the new state kept) and rejected (the state rolled back)
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert engine.kv_manager.state_rollbacks > 0
    assert_same_outputs(got, want)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("arch", families(["qwen3_5"], ["mamba2"]))
def test_speculation_on_a_state_model_stays_exact_under_preemption(arch, mode, checkpoints):
    path = str(checkpoints(arch))
    want, engine = run_requests(path, _spec_requests(), 4000, block_size=4,
                                kv_cache_memory=1 << 24)
    states = _state_blocks(engine)
    # (about two sequences' states and a few attention blocks: a pure state model three states)
    blocks = 2 * states + 10 if states < engine.kv_layout.width else 3 * states
    got, engine = _speculating(path, want, num_kv_blocks=blocks, preemption_mode=mode,
                               num_cpu_blocks=blocks if mode == "swap" else 0,
                               max_num_batched_tokens=8, enable_prefix_caching=True)
    assert engine.scheduler.preemptions_by_mode[mode] > 0
    assert engine.kv_manager.state_rollbacks > 0 and engine.spec.num_accepted_tokens > 0
    assert_same_outputs(got, want)


def test_ngram_speculation_is_served_for_a_state_model(checkpoints):
    path = str(checkpoints("mamba"))
    prompt = PROMPTS[1] * 3  # (a repeated prompt: the n-gram proposer drafts from it)
    want = LLM(path, dtype="float32").generate([{"prompt_token_ids": prompt}], greedy(12),
                                               use_tqdm=False)
    llm = LLM(path, dtype="float32", speculative_config=SPEC)
    got = llm.generate([{"prompt_token_ids": prompt}], greedy(12), use_tqdm=False)
    assert llm.engine.spec.num_draft_tokens > 0
    assert_same_outputs(got, want)


def test_a_draft_model_is_refused_and_a_new_block_size_refits_the_state(checkpoints):
    path = str(checkpoints("qwen3_5"))
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(path, dtype="float32", speculative_config={"model": str(checkpoints("qwen3_5")),
                                                       "num_speculative_tokens": 2})
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    want = llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(8), use_tqdm=False)
    lanes = len(llm.engine.kv_layout.state_columns())
    # 16-token blocks hold 4x the state a block: a quarter of the entries (rounded up)
    llm.engine.reconfigure_cache(block_size=16)
    assert len(llm.engine.kv_layout.state_columns()) < lanes
    got = llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(8), use_tqdm=False)
    assert ours_as_pairs(got[0].outputs[0]) == ours_as_pairs(want[0].outputs[0])


def test_a_refused_reconfiguration_leaves_the_state_bound_to_the_block_size_it_asked(checkpoints):
    # the rebind stands when the cache build refuses the rest of the settings: going back to the
    # first block size must bind the state to it again
    path = str(checkpoints("qwen3_5"))
    llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    want = llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(6), use_tqdm=False)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):  # (refused by the scheduler)
        llm.engine.reconfigure_cache(block_size=16, max_num_batched_tokens=2,
                                     enable_chunked_prefill=False)
    llm.engine.reconfigure_cache(block_size=4)
    got = llm.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(6), use_tqdm=False)
    assert ours_as_pairs(got[0].outputs[0]) == ours_as_pairs(want[0].outputs[0])


def test_a_shared_system_prompt_is_snapshotted_where_the_second_request_leaves_it(checkpoints):
    # S + a question, S + another, S + a third: the first caches S's attention blocks, the second
    # finds them (but no snapshot inside S), so its prompt chunk ends at S's last full block (the
    # junction) and its state there is snapshotted; the third starts from it
    path = str(checkpoints("qwen3_5"))
    system = prompts_of_lengths([18], seed=41)[0]
    asks = [system + q for q in ([5, 6, 7], [8, 9, 10, 11], [12, 13])]
    opts = dict(dtype="float32", block_size=4, kv_cache_memory=1 << 24)
    llm = LLM(path, enable_prefix_caching=True, **opts)
    kv = llm.engine.kv_manager
    got, hits = [], []
    for prompt in asks:
        got += llm.generate([{"prompt_token_ids": prompt}], greedy(6), use_tqdm=False)
        hits.append(kv.prefix_hits)
    assert hits == [0, 0, 16]
    cold = LLM(path, enable_prefix_caching=False, **opts)
    want = cold.generate([{"prompt_token_ids": p} for p in asks], greedy(6), use_tqdm=False)
    assert_same_outputs(got, want)
