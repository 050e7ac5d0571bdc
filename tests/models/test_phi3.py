"""Our Phi-3 (fused qkv / gate_up split at load, LongRoPE, partial rotary) equals HF transformers."""

import torch
import transformers

from pagedserve.models.loader import iter_safetensors, load_model
from pagedserve.models.phi3 import Phi3ForCausalLM

VOCAB = 300


def tiny_phi3(**kw):
    # Phi-4-mini's shape of RoPE: 3/4 of each head rotated, LongRoPE from 16 to 64 positions.
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0], "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 13.0]}
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                original_max_position_embeddings=16, rope_parameters=rope, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    return transformers.Phi3Config(**{**base, **kw})


def test_phi3_longrope_partial_rotary_matches_hf(hf_pair, check_hf, prompts):
    """Served to its full 64 positions, the model rotates by the long factors: equal to HF's
    forward over sequences longer than the original 16 positions."""
    hf, model, _ = hf_pair(tiny_phi3())
    assert isinstance(model, Phi3ForCausalLM)
    rope = model.model.rotary_emb
    assert rope.rotary_dim == 12 and rope.uses_long_factors and rope.attention_scaling > 1
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (64, 64) and attn.k_proj.weight.shape == (32, 64)
    # the split halves are the checkpoint's rows: k is rows 64..96 of qkv_proj
    qkv = hf.model.layers[0].self_attn.qkv_proj.weight
    assert attn.k_proj.weight.equal(qkv[64:96]) and attn.v_proj.weight.equal(qkv[96:])
    check_hf(hf, model, prompts(VOCAB, lengths=(20, 17, 25)))


def test_phi3_served_within_the_original_context_uses_the_short_factors(hf_pair, check_hf, prompts):
    hf, _, folder = hf_pair(tiny_phi3())
    config = transformers.AutoConfig.from_pretrained(folder)
    model = load_model(config, weights=iter_safetensors(folder), dtype=torch.float32, max_model_len=16)
    assert not model.model.rotary_emb.uses_long_factors
    check_hf(hf, model, prompts(VOCAB))


def test_phi3_legacy_su_rope_type_reads_as_longrope(hf_pair, check_hf, prompts):
    def legacy(cfg):
        # (transformers 5 validates "su" as longrope only with the original length in the dict)
        cfg["rope_scaling"] = {"type": "su", "original_max_position_embeddings": 16,
                               **{k: v for k, v in cfg.pop("rope_parameters").items()
                                  if k in ("short_factor", "long_factor")}}
        cfg["rope_theta"], cfg["partial_rotary_factor"] = 10000.0, 0.75
        return cfg

    hf, model, _ = hf_pair(tiny_phi3(), edit_config=legacy)
    assert model.model.rotary_emb.rope_type == "longrope"
    check_hf(hf, model, prompts(VOCAB, lengths=(20, 17)))

