"""Our Qwen3.5 (dense and MoE; causal LM checkpoints and the text decoder of the multimodal
ones) equals HF transformers in float32; chunked prefill is bit-identical to a whole prefill."""

import pytest
import torch
import transformers

from pagedserve.models.qwen3_5 import (
    Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration)
from test_qwen3_next import TYPES, needs_invariant_kernels, prefill_in_pieces

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, layer_types=TYPES, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def dense_config(**overrides):
    return transformers.Qwen3_5TextConfig(**{**COMMON, "intermediate_size": 96, **overrides})


def moe_config(**overrides):
    return transformers.Qwen3_5MoeTextConfig(**{**COMMON, **MOE, **overrides})


def test_qwen3_5_dense_matches_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(dense_config(), std=0.15)
    assert type(model) is Qwen3_5ForCausalLM
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_qwen3_5_moe_matches_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(moe_config(), std=0.15)
    assert type(model) is Qwen3_5MoeForCausalLM
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_qwen3_5_multimodal_text_decoder_matches_hf(hf_pair, check_hf, prompts, moe):
    if moe:
        config = transformers.Qwen3_5MoeConfig(text_config={**COMMON, **MOE}, vision_config=VISION)
        hf_class, ours = transformers.Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
    else:
        config = transformers.Qwen3_5Config(text_config={**COMMON, "intermediate_size": 96},
                                            vision_config=VISION)
        hf_class, ours = transformers.Qwen3_5ForConditionalGeneration, Qwen3_5ForConditionalGeneration
    hf, model, _ = hf_pair(config, std=0.15, hf_class=hf_class)
    assert type(model) is ours
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_qwen3_5_chunked_prefill_is_bit_identical(hf_pair, paged_runner, prompts):
    needs_invariant_kernels()
    _, model, _ = hf_pair(moe_config())
    prompt = prompts(VOCAB, lengths=(10,))[0]
    whole = prefill_in_pieces(paged_runner, model, prompt, [10])
    for sizes in ([1] * 10, [3, 7], [6, 1, 3]):
        assert torch.equal(prefill_in_pieces(paged_runner, model, prompt, sizes, seed=4), whole), sizes


def test_a_pipeline_stage_refuses_a_model_with_recurrent_state():
    """Even where each Gated DeltaNet state fits one cache entry (as many entries as layers), a
    stage refuses it: its layers read a list of entries, and a state cannot be split by layer."""
    from pagedserve.worker.pp_executor import _Stage

    model = Qwen3_5ForCausalLM(dense_config())
    model.bind_cache(64, torch.float32)
    assert model.kv_cache_spec.num_layers == 4  # (one entry per layer at 64-token blocks)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        _Stage(model, 0, 2, True, False)
