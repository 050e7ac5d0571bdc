"""Our HunYuan V3 (per-head q/k norms; a dense first layer, then sigmoid-routed experts with a
selection bias, renormalized and scaled, beside a shared MLP) equals HF transformers in float32."""

import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.hy_v3 import HYV3ForCausalLM
from utils import add_gguf_tensor, finish_gguf

VOCAB = 300


def hy_v3_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                  num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=32,
                  router_scaling_factor=2.5, max_position_embeddings=128,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.HYV3Config(**kwargs)


def _draw_selection_bias(hf):  # (a zero buffer at init: drawn so that it moves the choice)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in hf.model.layers:
            bias = getattr(layer.mlp, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.rand(bias.shape, generator=gen) * 0.5)


def test_hy_v3_matches_hf(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(hy_v3_config(), prepare=_draw_selection_bias)
    assert isinstance(model, HYV3ForCausalLM)
    layers = model.model.layers
    assert not isinstance(layers[0].mlp, FusedMoE) and isinstance(layers[1].mlp, FusedMoE)
    assert layers[1].mlp.shared_expert is not None and layers[1].mlp.routing.routed_scaling_factor == 2.5
    bias = hf.model.layers[2].mlp.e_score_correction_bias
    assert bias.abs().sum() > 0 and torch.equal(layers[2].mlp.gate.e_score_correction_bias.float(), bias.float())
    check_hf(hf, model, prompts(VOCAB))


def test_hy_v3_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "hy_v3" GGUF (the expert keys; dense layers are those without a router):
    F32 equals HF; Q8_0 experts kept as stacked blocks give HF's greedy tokens by the tie rule."""
    import gguf
    from moe_gguf import check_greedy_tie_rule, load_gguf_model, stack_experts

    from pagedserve.models.loader import iter_safetensors

    # (seed 1: from seed 0's weights a bf16 run of the F32 file already leaves HF's greedy path
    # where no near-tie is -- bf16 noise on this tiny random model, the F32 run being exact)
    hf, _, folder = hf_pair(hy_v3_config(), prepare=_draw_selection_bias, seed=1)
    state = stack_experts(dict(iter_safetensors(folder)))
    c = hf.config
    leaves = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "mlp.router.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
              "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps",
              "mlp.shared_mlp.gate_proj": "ffn_gate_shexp", "mlp.shared_mlp.up_proj": "ffn_up_shexp",
              "mlp.shared_mlp.down_proj": "ffn_down_shexp"}
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

    def write(path, qtype):  # as conversion/hunyuan.py's HYV3Model (and TextModel's keys)
        w = gguf.GGUFWriter(str(path), "hy_v3")
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_block_count(c.num_hidden_layers)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.moe_intermediate_size * c.num_shared_experts)
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(c.router_scaling_factor)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        for hf_name, tensor in state.items():
            base, suffix = hf_name.rsplit(".", 1)
            if hf_name.endswith(".mlp.expert_bias"):
                name = f"blk.{hf_name.split('.')[2]}.exp_probs_b"  # (no suffix, as the converter names it)
            elif base in top:
                name = f"{top[base]}.{suffix}"
            else:
                layer, leaf = base.removeprefix("model.layers.").split(".", 1)
                name = f"blk.{layer}.{leaves[leaf]}.{suffix}"
            add_gguf_tensor(w, name, tensor.detach().float().numpy(), qtype,
                            quantize="embed" not in hf_name and "ffn_gate_inp" not in name)
        finish_gguf(w)
        return path

    model = load_gguf_model(write(tmp_path / "f32.gguf", gguf.GGMLQuantizationType.F32), tmp_path / "cache",
                            quantized=False)
    assert isinstance(model, HYV3ForCausalLM) and not isinstance(model.model.layers[0].mlp, FusedMoE)
    check_hf(hf, model, prompts(VOCAB))
    model = load_gguf_model(write(tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0), tmp_path / "cache",
                            quantized=True, dtype=torch.bfloat16)
    assert model.model.layers[-1].mlp.experts.gate_proj.dtype == torch.uint8
    check_greedy_tie_rule(hf, model, prompts(VOCAB)[:2], "hy_v3 Q8_0")
