"""Our Granite SWA and Granite MoE SWA (Granite's multipliers, sliding-window layers from
`layer_types`, a learned sink logit per head, a RoPE base per layer with NoPE at 0) equal HF
transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.layers.moe import FusedMoE
from pagedserve.models.granite_swa import GraniteMoeSWAForCausalLM, GraniteSWAForCausalLM
from utils import add_gguf_tensor, finish_gguf

VOCAB = 300
# a sliding layer (window 4) with RoPE at base 1e4, a full NoPE one, a sliding one at base 500
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, embedding_multiplier=3.0,
               residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5, sliding_window=4,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               layer_rope_theta=[1e4, 0, 500.0], tie_word_embeddings=False,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)


def granite_swa_config(moe: bool, shared: int = 48, **overrides):
    kwargs = {**_COMMON, **overrides}
    if moe:
        return transformers.GraniteMoeSWAConfig(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                                                shared_intermediate_size=shared, **kwargs)
    return transformers.GraniteSWAConfig(intermediate_size=128, **kwargs)


def _randomize_sinks(hf):  # (HF initializes them at 0: drawn so that they move the softmax)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen) * 2.0)


@pytest.mark.parametrize("moe", [False, True], ids=["granite_swa", "granitemoe_swa"])
def test_granite_swa_windows_sinks_and_layer_rope_match_hf(hf_pair, check_hf, prompts, moe):
    hf, model, _ = hf_pair(granite_swa_config(moe), prepare=_randomize_sinks)
    assert type(model) is (GraniteMoeSWAForCausalLM if moe else GraniteSWAForCausalLM)
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [4, None, 4]
    assert all(layer.self_attn.attn.scale == 0.2 for layer in layers)
    assert torch.equal(layers[1].self_attn.sinks.float(), hf.model.layers[1].self_attn.sinks.float())
    assert all(s.sinks for s in model.kv_cache_spec.layer_specs())
    if moe:
        assert isinstance(layers[0].mlp, FusedMoE) and layers[0].mlp.shared_expert is not None
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


@pytest.mark.parametrize("moe", [False, True], ids=["granite_swa", "granitemoe_swa"])
def test_granite_swa_default_layer_types_and_thetas_match_hf(hf_pair, check_hf, prompts, moe):
    """No `layer_types` / `layer_rope_theta`: HF's defaults (every fourth layer full, the global
    RoPE base everywhere)."""
    config = granite_swa_config(moe, num_hidden_layers=4, layer_types=None, layer_rope_theta=None)
    hf, model, _ = hf_pair(config, prepare=_randomize_sinks)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, 4, 4, 4]
    check_hf(hf, model, prompts(VOCAB))


# HF leaf -> llama.cpp's (conversion/granite.py: the MoE one's experts and shared MLP kept fused)
_GGUF_LEAVES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "self_attn.sinks": "attn_sinks",
                "block_sparse_moe.router": "ffn_gate_inp",
                "block_sparse_moe.experts.gate_up_proj": "ffn_gate_up_exps",
                "block_sparse_moe.experts.down_proj": "ffn_down_exps",
                "shared_mlp.input_linear": "ffn_up_shexp", "shared_mlp.output_linear": "ffn_down_shexp"}
_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def write_granite_swa_gguf(path, hf_model, qtype):
    """`hf_model` as convert_hf_to_gguf.py writes it (architecture "granite_swa"): Granite's
    keys, the window, its pattern (one flag a layer), the experts' counts; Q/K rows permuted,
    `attn_sinks`, 2-D / 3-D weights but the router as `qtype`."""
    import gguf

    c = hf_model.config
    w = gguf.GGUFWriter(str(path), "granite_swa")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_attention_scale(c.attention_multiplier)
    w.add_embedding_scale(c.embedding_multiplier)
    w.add_residual_scale(c.residual_multiplier)
    w.add_logit_scale(c.logits_scaling)
    w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    if getattr(c, "num_local_experts", None):
        w.add_expert_count(c.num_local_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if c.shared_intermediate_size:
            w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    d = c.hidden_size // c.num_attention_heads
    for hf_name, tensor in hf_model.state_dict().items():
        data = tensor.detach().float().numpy()
        base = hf_name.removesuffix(".weight")
        if base in _GGUF_TOP:
            name = _GGUF_TOP[base]
        else:
            layer, leaf = base.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{layer}.{_GGUF_LEAVES[leaf]}"
        for proj, heads in ((".q_proj.", c.num_attention_heads), (".k_proj.", c.num_key_value_heads)):
            if proj in hf_name:  # LlamaModel.permute
                data = data.reshape(heads, 2, d // 2, -1).swapaxes(1, 2).reshape(data.shape)
        add_gguf_tensor(w, f"{name}.weight", data, qtype, quantize="embed" not in hf_name and "router" not in hf_name)
    finish_gguf(w)
    return path


@pytest.mark.parametrize("moe", [False, True], ids=["granite_swa", "granitemoe_swa"])
def test_granite_swa_from_gguf_f32_and_kept_q8_0(hf_pair, check_hf, prompts, tmp_path, moe):
    """llama.cpp's "granite_swa" GGUF (the MoE one too): F32 equals HF; Q8_0 blocks kept (the
    fused experts split as rows of blocks) give HF's greedy tokens by the tie rule."""
    import gguf
    from moe_gguf import check_greedy_tie_rule, load_gguf_model

    # (a shared MLP of 64: Q8_0 rows are blocks of 32)
    hf, _, _ = hf_pair(granite_swa_config(moe, shared=64, layer_rope_theta=None), prepare=_randomize_sinks)
    f32 = write_granite_swa_gguf(tmp_path / "f32.gguf", hf, gguf.GGMLQuantizationType.F32)
    model = load_gguf_model(f32, tmp_path / "cache", quantized=False)
    assert type(model) is (GraniteMoeSWAForCausalLM if moe else GraniteSWAForCausalLM)
    check_hf(hf, model, prompts(VOCAB))
    q8 = write_granite_swa_gguf(tmp_path / "q8.gguf", hf, gguf.GGMLQuantizationType.Q8_0)
    model = load_gguf_model(q8, tmp_path / "cache", quantized=True, dtype=torch.bfloat16)
    if moe:
        experts = model.model.layers[-1].mlp.experts
        assert experts.gate_proj.dtype == torch.uint8 and experts.up_proj.dim() == 3
    check_greedy_tie_rule(hf, model, prompts(VOCAB)[:2], "granite_swa Q8_0")
