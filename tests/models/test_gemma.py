"""Our Gemma (1) (Gemma norms, scaled embeddings, GeLU-gated MLP, tied head) equals HF
transformers in float32."""

import transformers

from pagedserve.models.gemma import GemmaForCausalLM

VOCAB = 300


def test_gemma_matches_hf(hf_pair, check_hf, prompts):
    config = transformers.GemmaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    hf, model, _ = hf_pair(config, std=0.15)
    assert isinstance(model, GemmaForCausalLM) and model.tied
    assert model.model.layers[0].mlp.act_name == "gelu_pytorch_tanh"
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
