"""Our Apertus (xIELU MLP with learned scalars per layer, per-head q/k RMSNorms, Llama 3 RoPE
scaling) equals HF transformers in float32."""

import torch
import transformers

from pagedserve.models.apertus import ApertusForCausalLM

VOCAB = 300


def test_apertus_matches_hf(hf_pair, check_hf, prompts):
    config = transformers.ApertusConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                         "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0})

    def distinct_xielu(hf):  # each layer's scalars its own (HF initializes them all alike)
        with torch.no_grad():
            for i, layer in enumerate(hf.model.layers):
                layer.mlp.act_fn.beta.fill_(0.3 + 0.2 * i)
                layer.mlp.act_fn.eps.fill_(-0.05 * (i + 1))

    hf, model, _ = hf_pair(config, prepare=distinct_xielu)
    assert isinstance(model, ApertusForCausalLM)
    act = model.model.layers[1].mlp.act_fn
    assert torch.equal(act.alpha_p, hf.model.layers[1].mlp.act_fn.alpha_p) and float(act.beta) == 0.5
    assert model.model.layers[0].self_attn.q_norm is not None
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
