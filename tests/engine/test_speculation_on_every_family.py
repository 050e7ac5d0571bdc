"""Speculative decoding on every family (issue 35): rows of drafts accepted in full, in part and
not at all (spec_oracle.OracleDrafts) leave greedy and seeded-sampled tokens and logprobs exactly
those of the same requests without speculation -- dense, mixture-of-experts, latent attention,
sinks and sliding windows, per-layer inputs and KV sharing. (The recurrent families:
tests/engine/test_recurrent_families.py, whose state rolls back.)

A family per mechanism runs by default; `PAGEDSERVE_EVERY_FAMILY=1` runs every other dense and
MoE family too (~2 minutes more on 2 cores)."""

import os

import pytest

from pagedserve import SamplingParams
from spec_oracle import speculating
from test_llm_engine import prompts_of_lengths
from test_moe_engine import FAMILIES as MOE_FAMILIES
from tiny import DENSE_FAMILIES
from utils import assert_same_outputs, run_requests

PROMPTS = prompts_of_lengths([7, 12, 4], seed=61)
# one family per attention / cache mechanism: sliding windows (Gemma 2, Cohere 2), per-layer
# head sizes and KV sharing with per-layer inputs (Gemma 4, E-series), short convolutions (LFM2),
# latent attention (DeepSeek-V2, GLM-4.7-Flash), sinks (gpt-oss), chunked / NoPE layers (Llama 4,
# SmolLM3), LongRoPE (Phi-3), parallel residuals (GPT-NeoX), routed experts (Qwen3-MoE)
MECHANISMS = ["llama", "gemma2", "gemma3", "gemma4", "gemma4_e", "cohere2", "lfm2", "lfm2_moe",
              "deepseek_v2", "glm4_moe_lite", "gpt_oss", "llama4", "smollm3", "phi3", "gpt_neox",
              "qwen3_moe"]
EVERY = pytest.mark.skipif(not os.environ.get("PAGEDSERVE_EVERY_FAMILY"),
                           reason="PAGEDSERVE_EVERY_FAMILY=1 runs every family")
FAMILIES = MECHANISMS + [pytest.param(f, marks=EVERY) for f in
                         sorted({"qwen3", *DENSE_FAMILIES, *MOE_FAMILIES} - set(MECHANISMS))]


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
