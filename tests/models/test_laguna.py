"""Our Laguna (per-layer query heads, q/k norms, RoPE per layer type with a partial rotary part,
a softplus output gate per head or per channel, a sliding layer; a dense first layer, then
sigmoid-routed experts with a selection bias, a routed scaling factor and an ungated shared MLP)
equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.laguna import LagunaForCausalLM
from utils import add_gguf_tensor, finish_gguf

VOCAB = 300


def laguna_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_attention_heads_per_layer=[4, 8, 4],
                  num_experts=8, num_experts_per_tok=2, moe_routed_scaling_factor=2.5, sliding_window=4,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  mlp_layer_types=["dense", "sparse", "sparse"], max_position_embeddings=128,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.LagunaConfig(**kwargs)


def _draw_selection_bias(hf):  # (a zero buffer at init: drawn so that it moves the choice)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.rand(gate.e_score_correction_bias.shape, generator=gen) * 0.5)


@pytest.mark.parametrize("gating", [True, "per-element"], ids=["per_head", "per_element"])
def test_laguna_matches_hf(hf_pair, check_hf, prompts, gating):
    hf, model, _ = hf_pair(laguna_config(gating=gating), prepare=_draw_selection_bias)
    assert isinstance(model, LagunaForCausalLM)
    layers = model.model.layers
    assert [layer.self_attn.num_heads for layer in layers] == [4, 8, 4]
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [4, None, 4]
    assert not isinstance(layers[0].mlp, FusedMoE) and isinstance(layers[1].mlp, FusedMoE)
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0 and torch.equal(layers[1].mlp.gate.e_score_correction_bias.float(), bias.float())
    check_hf(hf, model, prompts(VOCAB))


def test_laguna_router_softcapping_is_refused():
    with pytest.raises(ValueError, match="moe_router_logit_softcapping"):
        LagunaForCausalLM(laguna_config(moe_router_logit_softcapping=30.0))


# gguf-py's names for Laguna (tensor_mapping.py; the installed gguf predates the architecture)
_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_GGUF_LEAVES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                "self_attn.k_norm": "attn_k_norm", "self_attn.g_proj": "attn_gate",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
                "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps",
                "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                "mlp.shared_expert.down_proj": "ffn_down_shexp"}


def write_laguna_gguf(path, hf_model, state, qtype):
    """The HF checkpoint `state` as convert_hf_to_gguf.py's LagunaModel writes it: per-layer head
    counts, both layer types' RoPE keys, the expert keys, no layer pattern (llama.cpp's: every
    fourth layer full, from the first); experts stacked, the selection bias as `exp_probs_b.bias`;
    2-D / 3-D weights but the router as `qtype`."""
    import gguf
    from moe_gguf import stack_experts

    c = hf_model.config
    w = gguf.GGUFWriter(str(path), "laguna")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(list(c.num_attention_heads_per_layer))
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_vocab_size(c.vocab_size)
    w.add_sliding_window(c.sliding_window)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_expert_weights_norm(True)
    w.add_expert_weights_scale(c.moe_routed_scaling_factor)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(c.mlp_layer_types.index("sparse"))
    full, swa = c.rope_parameters["full_attention"], c.rope_parameters["sliding_attention"]
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_freq_base_swa(swa["rope_theta"])
    w.add_rope_dimension_count(int(c.head_dim * full["partial_rotary_factor"]))
    w.add_rope_dimension_count_swa(int(c.head_dim * swa["partial_rotary_factor"]))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for hf_name, tensor in stack_experts(state).items():
        base, suffix = hf_name.rsplit(".", 1)
        if base in _GGUF_TOP:
            name = f"{_GGUF_TOP[base]}.{suffix}"
        elif hf_name.endswith("e_score_correction_bias"):
            name = f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias"
        else:
            layer, leaf = base.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{layer}.{_GGUF_LEAVES[leaf]}.{suffix}"
        add_gguf_tensor(w, name, tensor.detach().float().numpy(), qtype,
                        quantize="embed" not in hf_name and "ffn_gate_inp" not in name)
    finish_gguf(w)
    return path


# llama.cpp's layer pattern (no key in the file): the full layers at i % 4 == 0; HF's default RoPE
# (full: base 500000 on half of each head; sliding: base 10000 on all of it)
_GGUF = dict(num_hidden_layers=4, num_attention_heads_per_layer=[8, 4, 4, 4], rope_parameters=None,
             layer_types=["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
             mlp_layer_types=["dense", "sparse", "sparse", "sparse"], shared_expert_intermediate_size=64)


@pytest.mark.parametrize("gating", [True, "per-element"], ids=["per_head", "per_element"])
def test_laguna_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path, gating):
    """llama.cpp's "laguna" GGUF: F32 equals HF; Q8_0 experts kept as stacked blocks give HF's
    greedy tokens by the tie rule."""
    import gguf
    from moe_gguf import check_greedy_tie_rule, load_gguf_model

    from pagedserve.models.loader import iter_safetensors

    hf, _, folder = hf_pair(laguna_config(gating=gating, **_GGUF), prepare=_draw_selection_bias)
    state = dict(iter_safetensors(folder))
    f32 = write_laguna_gguf(tmp_path / "f32.gguf", hf, state, gguf.GGMLQuantizationType.F32)
    model = load_gguf_model(f32, tmp_path / "cache", quantized=False)
    assert isinstance(model, LagunaForCausalLM)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, 4, 4, 4]
    check_hf(hf, model, prompts(VOCAB))
    q8 = write_laguna_gguf(tmp_path / "q8.gguf", hf, state, gguf.GGMLQuantizationType.Q8_0)
    model = load_gguf_model(q8, tmp_path / "cache", quantized=True, dtype=torch.bfloat16)
    assert model.model.layers[-1].mlp.experts.gate_proj.dtype == torch.uint8
    check_greedy_tie_rule(hf, model, prompts(VOCAB)[:2], "laguna Q8_0")
