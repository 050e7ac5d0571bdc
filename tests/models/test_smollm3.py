"""Our SmolLM3 (no RoPE on every fourth layer) equals HF transformers."""

import torch
import transformers

from pagedserve.models.smollm3 import SmolLM3ForCausalLM

VOCAB = 300


def test_smollm3_nope_layers_match_hf(hf_pair, check_hf, prompts):
    config = transformers.SmolLM3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf, model, _ = hf_pair(config)
    assert isinstance(model, SmolLM3ForCausalLM)
    assert model.model.use_rope == [True, True, True, False]
    _, extras = model.model.embed(torch.tensor([3, 4]), torch.tensor([0, 7]))
    cos, sin = extras[3][0]
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))
    check_hf(hf, model, prompts(VOCAB))
