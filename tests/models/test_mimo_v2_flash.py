"""Our MiMo-V2-Flash (q/k heads of 24 and value heads of 16 scaled by attention_value_scale,
partial RoPE per layer type, sliding layers with twice the KV heads and sinks, full layers
without; a dense first layer, then DeepSeek-V3-routed experts) equals HF transformers in float32."""

import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from utils import add_gguf_tensor, finish_gguf

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


_LEAVES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
           "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def write_mimo2_gguf(path, hf_model, state, qtype):
    """The HF checkpoint `state` as convert_hf_to_gguf.py's MimoV2Model writes it (no MTP
    blocks): KV heads per block, the window and its pattern, both widths, the rotated part, both
    RoPE bases, the value scale, the expert keys; `attn_sinks.weight`, experts stacked, the
    selection bias as `exp_probs_b.bias`; 2-D / 3-D weights but the router as `qtype`."""
    import gguf
    from moe_gguf import stack_experts

    c = hf_model.config
    sliding = [t == "sliding_attention" for t in c.layer_types]
    w = gguf.GGUFWriter(str(path), "mimo2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([2 * c.num_key_value_heads if s else c.num_key_value_heads for s in sliding])
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_key_length(c.head_dim)
    w.add_value_length(c.v_head_dim)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern([int(s) for s in sliding])
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["full_attention"]["partial_rotary_factor"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_float32("mimo2.attention.value_scale", c.attention_value_scale)  # (add_attn_value_scale: newer gguf-py)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for hf_name, tensor in stack_experts(state).items():
        base, suffix = hf_name.rsplit(".", 1)
        layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
        if base in _TOP:
            name = f"{_TOP[base]}.{suffix}"
        elif hf_name.endswith("e_score_correction_bias"):
            name = f"blk.{layer}.exp_probs_b.bias"
        elif hf_name.endswith("attention_sink_bias"):
            name = f"blk.{layer}.attn_sinks.weight"
        else:
            name = f"blk.{layer}.{_LEAVES[base.split('.', 3)[3]]}.{suffix}"
        add_gguf_tensor(w, name, tensor.detach().float().numpy(), qtype,
                        quantize="embed" not in hf_name and "ffn_gate_inp" not in name)
    finish_gguf(w)
    return path


def test_mimo_v2_flash_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "mimo2" GGUF: F32 equals HF; Q8_0 experts kept as stacked blocks give HF's
    greedy tokens by the tie rule."""
    import gguf
    from moe_gguf import check_greedy_tie_rule, load_gguf_model

    from pagedserve.models.loader import iter_safetensors

    # (head width 32, value width 32: Q8_0 rows are blocks of 32; seed 1: from seed 0's weights
    # Q8_0 noise leaves HF's greedy path where no near-tie is, the F32 run being exact)
    hf, _, folder = hf_pair(mimo_config(head_dim=32, v_head_dim=32, attention_value_scale=0.5), prepare=_draw,
                            seed=1)
    state = dict(iter_safetensors(folder))
    f32 = write_mimo2_gguf(tmp_path / "f32.gguf", hf, state, gguf.GGMLQuantizationType.F32)
    model = load_gguf_model(f32, tmp_path / "cache", quantized=False)
    assert isinstance(model, MiMoV2FlashForCausalLM) and model.model.layers[1].self_attn.v_scale == 0.5
    check_hf(hf, model, prompts(VOCAB))
    q8 = write_mimo2_gguf(tmp_path / "q8.gguf", hf, state, gguf.GGMLQuantizationType.Q8_0)
    model = load_gguf_model(q8, tmp_path / "cache", quantized=True, dtype=torch.bfloat16)
    assert model.model.layers[-1].mlp.experts.gate_proj.dtype == torch.uint8
    check_greedy_tie_rule(hf, model, prompts(VOCAB)[:2], "mimo2 Q8_0")
