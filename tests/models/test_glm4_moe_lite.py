"""Our GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`: DeepSeek-V3's latent attention, GLM-4.5's MoE on
the `mlp_layer_types` layers) equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.glm4_moe_lite import Glm4MoeLiteForCausalLM
from pagedserve.models.llama import LlamaMLP

VOCAB = 300


def glm4_moe_lite_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        q_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=1.8, max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Glm4MoeLiteConfig(**kwargs)


def randomize_correction_bias(hf):
    """HF initializes e_score_correction_bias to zeros: give it values that move the choice."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(8, generator=gen) * 0.5)


@pytest.mark.parametrize("overrides,kinds", [
    ({}, [LlamaMLP, FusedMoE, FusedMoE]),  # HF's default: the first layer dense
    ({"mlp_layer_types": ["sparse", "dense", "sparse"], "rope_interleave": False, "q_lora_rank": None,
      "norm_topk_prob": False}, [FusedMoE, LlamaMLP, FusedMoE]),
], ids=["default", "layer-types-rotate-half-no-q-lora"])
def test_glm4_moe_lite_matches_hf(hf_pair, check_hf, prompts, overrides, kinds):
    hf, model, _ = hf_pair(glm4_moe_lite_config(**overrides), prepare=randomize_correction_bias)
    assert isinstance(model, Glm4MoeLiteForCausalLM)
    assert [type(layer.mlp) for layer in model.model.layers] == kinds
    assert model.kv_cache_spec.head_dim == 32 + 16  # one latent row per token
    assert model.model.layers[0].self_attn.rope_interleave == overrides.get("rope_interleave", True)
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, FusedMoE))
    assert moe.routing.scoring == "sigmoid" and moe.routing.routed_scaling_factor == 1.8
    assert moe.gate.e_score_correction_bias.abs().sum() > 0
    check_hf(hf, model, prompts(VOCAB))


def test_glm4_moe_lite_skips_the_mtp_layer_and_refuses_partial_rope(hf_pair, check_hf, prompts):
    """A checkpoint's multi-token-prediction layer (`model.layers.<num_hidden_layers>`) is not
    loaded (HF skips it too); a partial rotary factor is refused by name."""
    import safetensors.torch

    from pagedserve.models.loader import iter_safetensors, load_model

    hf, _, folder = hf_pair(glm4_moe_lite_config(), prepare=randomize_correction_bias)
    state = safetensors.torch.load_file(folder / "model.safetensors")
    n = hf.config.num_hidden_layers
    state.update({k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v.clone()
                  for k, v in state.items() if k.startswith(f"model.layers.{n - 1}.")})
    safetensors.torch.save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = transformers.AutoConfig.from_pretrained(folder)
    check_hf(hf, load_model(config, weights=iter_safetensors(folder), dtype=torch.float32),
             prompts(VOCAB, lengths=(7,)))
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        Glm4MoeLiteForCausalLM(config)


def test_glm4_moe_lite_from_gguf_deepseek2(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp writes GLM-4.7-Flash as "deepseek2" (conversion/glm.py): the dense first layer
    as leading_dense_block_count, the correction bias as exp_probs_b, kv_b split into attn_k_b /
    attn_v_b, and no expert_gating_func (its config.json has no scoring_func): loaded as DeepSeek
    V3 with sigmoid routing, it equals HF."""
    from test_gguf_families import _deepseek2_meta, _gguf_tensors, _write

    from pagedserve.models.gguf_loader import iter_gguf_weights, load_gguf_config
    from pagedserve.models.loader import load_model

    hf, _, _ = hf_pair(glm4_moe_lite_config(), prepare=randomize_correction_bias)
    config = hf.config
    config.first_k_dense_replace = config.mlp_layer_types.index("sparse")  # (the hub's config.json)
    path = _write(tmp_path / "glm.gguf", "deepseek2", config,
                  _gguf_tensors("deepseek2", config, hf.state_dict()), _deepseek2_meta(config))
    ours = load_gguf_config(path, cache_dir=tmp_path)
    assert ours.model_type == "deepseek_v3" and ours.scoring_func == "sigmoid"
    assert ours.first_k_dense_replace == 1 and ours.q_lora_rank == 24
    model = load_model(ours, weights=iter_gguf_weights(path, ours), dtype=torch.float32)
    check_hf(hf, model, prompts(VOCAB))
