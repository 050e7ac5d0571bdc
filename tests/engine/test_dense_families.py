"""The dense families of issue 35 in the engine: greedy equal to HF's generate (tie rule), and a
run that moves KV around -- chunked prefill, preemption by swap and by recomputation, prefix
caching -- plus beam search under swapping give exactly the roomy run's tokens and logprobs."""

import pytest

from pagedserve import BeamSearchParams
from test_llm_engine import greedy, prompts_of_lengths
from tiny import DENSE_FAMILIES
from utils import assert_same_outputs, assert_tie_rule, hf_greedy, ours_as_pairs, run_requests

BASE = prompts_of_lengths([9], seed=21)[0]
# two pairs of prompts sharing their first 8 tokens (two blocks of 4): prefix-cache hits
PROMPTS = prompts_of_lengths([6, 11, 5, 13], seed=21) + [BASE + [7, 8, 9], BASE + [10, 11]]
TIGHT = dict(block_size=4, num_kv_blocks=16, num_cpu_blocks=6, preemption_mode="auto",
             max_num_batched_tokens=8, enable_prefix_caching=True)


@pytest.mark.parametrize("arch", DENSE_FAMILIES)
def test_family_matches_hf_and_stays_exact_when_kv_moves(arch, checkpoints, hf_models):
    path = str(checkpoints(arch))
    requests = [(f"g{i}", p, greedy(14)) for i, p in enumerate(PROMPTS)]
    requests.append(("beam", PROMPTS[1], BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)))
    ref, _ = run_requests(path, requests, 2000, block_size=4, kv_cache_memory=1 << 24,
                          enable_chunked_prefill=False)
    for i in (0, 3):
        assert_tie_rule(ours_as_pairs(ref[i].outputs[0]), hf_greedy(hf_models(arch), PROMPTS[i], 14),
                        f"{arch} prompt {i} vs HF")
    # NOTE: Gemma 2's (OLMo 3's, Cohere 2's) sliding layers, LFM2's conv windows, and the full
    # layers are two KV groups drawing on one pool (a block holds one layer's KV): 16 blocks leave
    # no cached prefix alive to hit, 20 (Cohere 2, EXAONE 4: 18) keep swap, recompute and hits
    two_groups = {"gemma2": 20, "olmo3": 20, "cohere2": 18, "lfm2": 20, "exaone4": 18,
                  "gemma4": 24, "granite_swa": 24}  # KV blocks (Gemma 4: its sliding layers take two cache entries)
    two_groups.update(cwm=18, vaultgemma=22, exaone4_5=18)  # (densec)
    tight = {**TIGHT, "num_kv_blocks": two_groups[arch], "num_cpu_blocks": 8} if arch in two_groups else TIGHT
    outs, engine = run_requests(path, requests, 4000, **tight)
    sched = engine.scheduler
    assert sched.preemptions_by_mode["swap"] > 0 and sched.preemptions_by_mode["recompute"] > 0
    assert engine.kv_manager.prefix_hits > 0
    assert_same_outputs(outs, ref)


def test_longrope_factors_follow_the_served_max_model_len(checkpoints):
    """The tiny Phi-3 extends 4 positions to 512: served to 4 it keeps the short factors."""
    from pagedserve import LLM

    path = str(checkpoints("phi3"))
    for max_model_len, long in ((4, False), (64, True)):
        llm = LLM(path, dtype="float32", block_size=4, kv_cache_memory=1 << 22, max_model_len=max_model_len)
        assert llm.engine.model.model.rotary_emb.uses_long_factors is long
