"""Our Helium (Llama with float32-weight RMSNorms, q/k/v biases without an o bias) equals HF
transformers in float32."""

import transformers

from pagedserve.models.helium import HeliumForCausalLM

VOCAB = 300


def test_helium_matches_hf(hf_pair, check_hf, prompts):
    config = transformers.HeliumConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=128, attention_bias=True, pad_token_id=0,
                                       bos_token_id=1, eos_token_id=2)
    hf, model, _ = hf_pair(config)
    assert isinstance(model, HeliumForCausalLM)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
