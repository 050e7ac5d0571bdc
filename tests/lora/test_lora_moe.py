"""LoRA on a mixture-of-experts model (tiny Qwen3-MoE, float32): an adapter on the attention
projections matches HF + PEFT (tie rule) beside the base model in one batch; an adapter that
targets MLP projections is refused naming the module (the experts take none)."""

from __future__ import annotations

import pytest
import torch

import tiny
from pagedserve import LLM, LoRARequest, SamplingParams
from test_lora_adapter import key, write_adapter
from utils import assert_tie_rule, hf_greedy, ours_as_pairs

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
