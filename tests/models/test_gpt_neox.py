"""Our GPT-NeoX / Pythia (per-head interleaved fused q|k|v regrouped at load, parallel or
sequential residual on two LayerNorms, partial RoPE, biases, gelu MLP) equals HF transformers
in float32."""

import pytest
import torch
import transformers

from pagedserve.models.gpt_neox import GPTNeoXForCausalLM

VOCAB = 300


def gpt_neox_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    kwargs.update(overrides)
    return transformers.GPTNeoXConfig(**kwargs)


@pytest.mark.parametrize("parallel,rotary", [(True, 0.25), (False, 1.0)], ids=["pythia", "sequential"])
def test_gpt_neox_matches_hf(hf_pair, check_hf, prompts, parallel, rotary):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary}
    hf, model, _ = hf_pair(gpt_neox_config(use_parallel_residual=parallel, rope_parameters=rope))
    assert isinstance(model, GPTNeoXForCausalLM)
    layer, ref = model.model.layers[1], hf.gpt_neox.layers[1].attention.query_key_value
    assert layer.parallel == parallel and model.model.rotary_emb.rotary_dim == int(16 * rotary)
    # head 2's k rows are rows [2 * 48 + 16, 2 * 48 + 32) of HF's interleaved q|k|v
    assert torch.equal(layer.self_attn.k_proj.weight[32:48], ref.weight[2 * 48 + 16:2 * 48 + 32])
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
