"""Our CWM (Llama with sliding-window layers by `layer_types`, Llama 3 RoPE scaling) equals HF
transformers in float32."""

import transformers

from pagedserve.models.cwm import CwmForCausalLM

VOCAB = 300


def test_cwm_matches_hf(hf_pair, check_hf, prompts):
    config = transformers.CwmConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=4, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    hf, model, _ = hf_pair(config)
    assert isinstance(model, CwmForCausalLM)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, 4, 4, 4]
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
