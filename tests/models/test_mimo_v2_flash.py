"""Our MiMo-V2-Flash (q/k heads of 24 and value heads of 16 scaled by attention_value_scale,
partial RoPE per layer type, sliding layers with twice the KV heads and sinks, full layers
without; a dense first layer, then DeepSeek-V3-routed experts) equals HF transformers in float32."""

import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.mimo_v2_flash import MiMoV2FlashForCausalLM

VOCAB = 300


def mimo_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=24, v_head_dim=16,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                  sliding_window=4, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                  max_position_embeddings=128, tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.MiMoV2FlashConfig(**kwargs)


def _draw(hf):  # (the selection bias, a zero buffer at init, and the sinks: drawn so that they matter)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and getattr(gate, "e_score_correction_bias", None) is not None:
                gate.e_score_correction_bias.copy_(torch.rand(gate.e_score_correction_bias.shape, generator=gen) * 0.5)
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen) * 2.0)


def test_mimo_v2_flash_matches_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(mimo_config(), prepare=_draw)
    assert isinstance(model, MiMoV2FlashForCausalLM)
    layers = model.model.layers
    assert [layer.self_attn.num_kv_heads for layer in layers] == [2, 4, 4]
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, 4, 4]
    assert layers[0].self_attn.sinks is None and layers[1].self_attn.sinks is not None
    assert torch.equal(layers[1].self_attn.sinks.float(), hf.model.layers[1].self_attn.sinks.float())
    assert not isinstance(layers[0].mlp, FusedMoE) and isinstance(layers[1].mlp, FusedMoE)
    assert [s.sinks for s in model.kv_cache_spec.layer_specs()] == [False, True, True]
    check_hf(hf, model, prompts(VOCAB))
