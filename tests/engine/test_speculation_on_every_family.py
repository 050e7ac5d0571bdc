"""Speculative decoding on every family (issue 35): rows of drafts accepted in full, in part and
not at all (spec_oracle.OracleDrafts) leave greedy and seeded-sampled tokens and logprobs exactly
those of the same requests without speculation -- dense, mixture-of-experts, latent attention,
sinks and sliding windows, per-layer inputs and KV sharing. (The recurrent families:
tests/engine/test_recurrent_families.py, whose state rolls back.)

A family per mechanism runs by default; `PAGEDSERVE_EVERY_FAMILY=1` runs every other dense and
MoE family too (~3 minutes more on 2 cores)."""

import pytest

from pagedserve import SamplingParams
from spec_oracle import speculating
from test_llm_engine import prompts_of_lengths
from test_moe_engine import FAMILIES as MOE_FAMILIES
from tiny import DENSE_FAMILIES
from utils import assert_same_outputs, families, run_requests

PROMPTS = prompts_of_lengths([7, 12, 4], seed=61)
# one family per attention / cache mechanism: sliding windows with soft-capping (Gemma 2), KV
# sharing with per-layer inputs (Gemma 4 E-series), short convolutions (LFM2), latent attention
# (DeepSeek-V2), sinks (gpt-oss), chunked / NoPE layers (Llama 4), LongRoPE (Phi-3), routed
# experts (Qwen3-MoE)
MECHANISMS = ["gemma2", "gemma4_e", "lfm2", "deepseek_v2", "gpt_oss", "llama4", "phi3", "qwen3_moe"]
FAMILIES = families(MECHANISMS, sorted({"llama", "qwen3", "gemma3", *DENSE_FAMILIES,
                                          *MOE_FAMILIES}))


def _requests():
    reqs = [(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                        logprobs=2)) for i, p in enumerate(PROMPTS)]
    reqs.append(("s", PROMPTS[0], SamplingParams(temperature=0.9, seed=3, max_tokens=8,
                                                 ignore_eos=True, logprobs=1)))
    return reqs


@pytest.mark.parametrize("arch", FAMILIES)
def test_speculation_leaves_every_familys_outputs_exactly_as_without(arch, checkpoints):
    path = str(checkpoints(arch))
    want, _ = run_requests(path, _requests(), 2000, block_size=4, kv_cache_memory=1 << 24)
    got, engine = speculating(path, _requests(), want, kv_cache_memory=1 << 24)
    assert 0 < engine.spec.num_accepted_tokens < engine.spec.num_draft_tokens
    assert_same_outputs(got, want)
