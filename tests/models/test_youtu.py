"""Our Youtu (DeepSeek V3's latent attention, interleaved RoPE, a dense gated MLP in every layer,
a tied LM head) equals HF transformers in float32."""

import pytest
import transformers

from pagedserve.layers.mla import MLAttention
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.youtu import YoutuForCausalLM

VOCAB = 300


@pytest.mark.parametrize("q_lora_rank,interleave", [(24, True), (None, False)], ids=["q-lora", "no-q-lora"])
def test_youtu_matches_hf(hf_pair, check_hf, prompts, q_lora_rank, interleave):
    config = transformers.YoutuConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, rope_interleave=interleave, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf, model, _ = hf_pair(config)
    assert isinstance(model, YoutuForCausalLM)
    layer = model.model.layers[1]
    assert isinstance(layer.self_attn, MLAttention) and isinstance(layer.mlp, LlamaMLP)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
