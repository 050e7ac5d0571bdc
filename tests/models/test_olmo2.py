"""Our OLMo 2 (post-norms, q/k norms over the whole projection) equals HF transformers."""

import transformers

from pagedserve.models.olmo2 import Olmo2ForCausalLM

VOCAB = 300


def test_olmo2_post_norms_match_hf(hf_pair, check_hf, prompts):
    config = transformers.Olmo2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf, model, _ = hf_pair(config)
    assert isinstance(model, Olmo2ForCausalLM)
    layer = model.model.layers[0]
    assert not hasattr(layer, "input_layernorm") and layer.self_attn.q_norm.weight.shape == (64,)
    check_hf(hf, model, prompts(VOCAB))
