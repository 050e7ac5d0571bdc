"""LoRA on mixture-of-experts models (tiny, float32): an adapter on the attention
projections matches HF + PEFT (tie rule) beside the base model in one batch; an adapter that
targets MLP projections is refused naming the module (the experts take none)."""

from __future__ import annotations

import pytest
import torch

import tiny
from pagedserve import LLM, LoRARequest, SamplingParams
from test_lora_adapter import key, write_adapter
from utils import assert_tie_rule, families, hf_greedy, ours_as_pairs

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)


def test_attention_adapter_on_an_moe_model_matches_hf_peft_and_mlp_targets_are_refused(
        checkpoints, tmp_path):
    base = checkpoints("qwen3_moe")
    adapter = tiny.make_lora_adapter(tmp_path / "attn", base, 8, seed=1,
                                     targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    lora = LoRARequest("attn", 1, str(adapter))
    prompts = [[1, 5, 9, 30, 7, 2, 11], [1, 44, 3, 17]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], GREEDY, use_tqdm=False,
                        lora_request=[lora, lora, None, None])
    peft = tiny.load_hf_with_adapter(base, adapter)
    plain = tiny.load_hf(base)
    for i, prompt in enumerate(prompts):
        with_adapter = hf_greedy(peft, prompt, 8)
        assert_tie_rule(ours_as_pairs(outs[i].outputs[0]), with_adapter, f"adapter {i}")
        assert_tie_rule(ours_as_pairs(outs[2 + i].outputs[0]), hf_greedy(plain, prompt, 8), f"base {i}")
        assert outs[i].outputs[0].token_ids != outs[2 + i].outputs[0].token_ids or \
            outs[i].outputs[0].cumulative_logprob != outs[2 + i].outputs[0].cumulative_logprob

    mlp = write_adapter(tmp_path / "mlp", {key(0, "gate_proj", "A", "mlp"): torch.randn(4, 64),
                                           key(0, "gate_proj", "B", "mlp"): torch.randn(96, 4)},
                        target_modules=["gate_proj"])
    with pytest.raises(ValueError, match="gate_proj.*not adapted in this model"):
        llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("mlp", 2, str(mlp)))
    assert llm.engine.num_used_blocks() == 0


# Attention targets per family, as a PEFT user names them (LFM2's attention output is out_proj in
# HF, beside its convolution's out_proj: a pattern picks the attention's)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
FAMILY_TARGETS = {
    "deepseek_v2": _MLA, "glm4_moe_lite": _MLA, "kimi_linear": _ATTENTION + _MLA,
    "qwen3_next": _ATTENTION, "qwen3_5_moe": _ATTENTION, "gemma4_moe": _ATTENTION,
    "gpt_oss": _ATTENTION, "llama4": _ATTENTION, "granitemoehybrid": _ATTENTION,
    "lfm2_moe": r".*\.self_attn\.(q_proj|k_proj|v_proj|out_proj)",
    # this round's MoE families
    "afmoe": _ATTENTION, "exaone_moe": _ATTENTION, "solar_open": _ATTENTION,
    "cohere2_moe": _ATTENTION, "granitemoe_swa": _ATTENTION, "laguna": _ATTENTION,
    "mimo_v2_flash": _ATTENTION, "hy_v3": _ATTENTION,
}


@pytest.mark.parametrize("family", families(
    ["deepseek_v2", "glm4_moe_lite", "qwen3_next", "lfm2_moe", "gemma4_moe"], sorted(FAMILY_TARGETS)))
def test_attention_adapters_on_latent_hybrid_and_per_layer_moe_models_match_hf_peft(
        family, checkpoints, tmp_path):
    # latent attention (q_a / q_b / kv_a / o; kv_b_proj is absorbed), hybrids whose
    # linear-attention or convolution layers take none, per-layer head sizes (Gemma 4)
    base = checkpoints(family)
    targets = FAMILY_TARGETS[family]
    adapter = tiny.make_lora_adapter(tmp_path / "attn", base, 4, seed=2, targets=targets,
                                     b_std=0.2)
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_loras=1,
              max_lora_rank=4)
    lora = LoRARequest("attn", 1, str(adapter))
    prompt = [1, 5, 9, 30, 7, 2, 11]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, GREEDY, use_tqdm=False,
                        lora_request=[lora, None])
    ours, ref = ours_as_pairs(outs[0].outputs[0]), hf_greedy(
        tiny.load_hf_with_adapter(base, adapter), prompt, 8)
    assert_tie_rule(ours, ref, family)
    # and the chosen tokens' logprobs agree up to the first difference (float32)
    for i, (x, y) in enumerate(zip(ours[0], ref[0])):
        if x != y:
            break
        assert abs(ours[1][i][x] - ref[1][i][y]) < 2e-3, f"{family} position {i}"
    assert_tie_rule(ours_as_pairs(outs[1].outputs[0]), hf_greedy(tiny.load_hf(base), prompt, 8),
                    f"{family} base")
    # the adapter changes the logprobs (its products reached the model)
    assert outs[0].outputs[0].cumulative_logprob != outs[1].outputs[0].cumulative_logprob
    assert llm.engine.num_used_blocks() == 0


def test_an_adapter_on_kv_b_proj_is_refused_naming_the_absorption(checkpoints, tmp_path):
    base = checkpoints("deepseek_v2")
    adapter = tiny.make_lora_adapter(tmp_path / "kvb", base, 4, seed=3,
                                     targets=("kv_b_proj", "o_proj"))
    llm = LLM(str(base), dtype="float32", block_size=4, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="kv_b_proj.*absorbs"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("kvb", 1, str(adapter)))
