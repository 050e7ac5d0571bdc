"""Tiny random checkpoints for tests: an HF config per architecture, weights large enough that
logits are not flat, a small byte-level BPE tokenizer, saved as an HF folder (safetensors)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

VOCAB = 512


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pagedserve.bench.trace import corpus_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([corpus_text()[:200_000]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def config_for(arch: str, **overrides):
    """A tiny transformers config of the given architecture (2-4 layers, hidden 64)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=512, **common)
    elif arch == "mistral":
        cfg = tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, sliding_window=7,
                               max_position_embeddings=512, **common)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, sliding_window=7,
                             use_sliding_window=False, max_position_embeddings=512, **common)
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=512, **common)
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                  query_pre_attn_scalar=24, sliding_window=6,
                                  layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                  max_position_embeddings=512, **common)
    elif arch == "opt":
        cfg = tf.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=512,
                           word_embed_proj_dim=64, **common)
    elif arch == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
    # mixture of experts (layers/moe.py): 8 experts of width 32, 2 routed per token
    elif arch == "mixtral":
        cfg = tf.MixtralConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                               num_experts_per_tok=2, max_position_embeddings=512, **common)
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                num_experts_per_tok=2, max_position_embeddings=512, **common)
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, max_position_embeddings=512, **common)
    elif arch == "olmoe":
        cfg = tf.OlmoeConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                             num_experts_per_tok=2, max_position_embeddings=512, **common)
    elif arch == "granitemoe":  # Granite's multipliers, softmax over the top-k logits, a shared MLP
        cfg = tf.GraniteMoeSharedConfig(hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=8,
                                        num_experts_per_tok=2, embedding_multiplier=3.0,
                                        residual_multiplier=0.5, attention_multiplier=0.2,
                                        logits_scaling=2.5, max_position_embeddings=512, **common)
    elif arch == "glm4_moe":  # half-rotary RoPE, q/k norms, sigmoid grouped routing, shared expert
        cfg = tf.Glm4MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                               n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                               routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                               max_position_embeddings=512, **common)
    elif arch == "ernie4_5_moe":  # interleaved RoPE, biases, a selection bias, shared expert
        cfg = tf.Ernie4_5_MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    num_experts=8, num_experts_per_tok=2, moe_num_shared_experts=1,
                                    moe_layer_start_index=1, use_bias=True,
                                    max_position_embeddings=512, **common)
    elif arch == "lfm2_moe":  # a dense conv layer, then attention with sigmoid-routed experts
        cfg = tf.Lfm2MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               num_experts=8, num_experts_per_tok=2, num_dense_layers=1,
                               layer_types=["conv", "full_attention"], conv_L_cache=3,
                               max_position_embeddings=512, **common)  # (scaling: 1, as GGUF keeps it)
    elif arch == "phimoe":  # LayerNorms, q/k/v/o and LM head biases, sparsemixer, LongRoPE past 64
        cfg = tf.PhimoeConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                              num_experts_per_tok=2, attention_bias=True, lm_head_bias=True,
                              max_position_embeddings=512, rope_parameters=_PHIMOE_ROPE, **common)
    elif arch == "minimax_m2":  # whole-projection q/k norms, half-rotary RoPE, sigmoid + selection bias
        cfg = tf.MiniMaxM2Config(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5}, **common)
    elif arch == "llama4":  # RoPE (pairs, L2 q/k norm) / NoPE (temperature from position 3) layers,
        # each dense and with sigmoid top-1 experts on their input + a shared expert; chunked
        # attention of 256 (the engine serves 256 tokens: models/llama4.py)
        cfg = tf.Llama4TextConfig(hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, num_local_experts=8, num_experts_per_tok=1,
                                  moe_layers=[1, 2], no_rope_layers=[1, 0, 1, 0], floor_scale=4,
                                  attn_scale=0.5, attention_chunk_size=256, rope_parameters=_LLAMA4_ROPE,
                                  max_position_embeddings=512, **common)
    elif arch == "dots1":  # Qwen3's attention with biases, DeepSeek-V3's routing after a dense layer
        cfg = tf.Dots1Config(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                             first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True,
                             routed_scaling_factor=2.5, attention_bias=True, sliding_window=None,
                             max_position_embeddings=512, **common)
    elif arch == "glm4_moe_lite":  # GLM-4.7-Flash: MLA (latent 32 + rope 16), sigmoid grouped MoE
        cfg = tf.Glm4MoeLiteConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                   q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=16,
                                   qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                                   num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                                   routed_scaling_factor=1.8, max_position_embeddings=512, **common)
    elif arch == "hunyuan_v1_moe":  # Hunyuan-A13B: HunYuan's attention, softmax top-k + shared MLP
        cfg = tf.HunYuanMoEV1Config(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    num_experts=8, moe_topk=2, rope_parameters=_HUNYUAN_ROPE,
                                    max_position_embeddings=512, **common)
    elif arch == "granitemoe_swa":  # Granite MoE Shared with a sliding layer, sinks, a NoPE full layer
        cfg = tf.GraniteMoeSWAConfig(**_GRANITE_SWA, **common, intermediate_size=32, num_local_experts=8,
                                     num_experts_per_tok=2, shared_intermediate_size=48)
    elif arch == "laguna":  # a sliding layer of 8 heads and a full one of 4 (half-rotary), softplus
        # gates; a dense layer, then sigmoid-routed experts (selection bias, scaling) + shared MLP
        cfg = tf.LagunaConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, num_attention_heads_per_layer=[8, 4],
                              num_experts=8, num_experts_per_tok=2, moe_routed_scaling_factor=2.5,
                              sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                              mlp_layer_types=["dense", "sparse"], max_position_embeddings=512,
                              tie_word_embeddings=False, **common)
    elif arch == "hy_v3":  # HunYuan V3: q/k norms; a dense layer, then sigmoid experts + shared MLP
        cfg = tf.HYV3Config(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                            num_experts_per_tok=2, router_scaling_factor=2.5, max_position_embeddings=512,
                            **common)
    elif arch == "mimo_v2_flash":  # a full layer, then a sliding one (twice the KV heads, sinks);
        # q/k heads of 24, value heads of 16; a dense layer, then DeepSeek-V3-routed experts
        cfg = tf.MiMoV2FlashConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                                   v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                   topk_group=1, routed_scaling_factor=2.5, sliding_window=6,
                                   layer_types=["full_attention", "sliding_attention"],
                                   max_position_embeddings=512, tie_word_embeddings=False, **common)
    elif arch == "gemma4_moe":  # Gemma 4's experts beside the dense MLP (26B-A4B's layout)
        cfg = tf.Gemma4TextConfig(**_GEMMA4, **common, enable_moe_block=True, num_experts=8, top_k_experts=2,
                                  moe_intermediate_size=32)
    elif arch in MORE_MOE_FAMILIES:
        cfg = _more_moe_config(tf, arch, common)
    elif arch in DENSE_FAMILIES:
        cfg = _dense_family_config(tf, arch, common)
    elif arch in RECURRENT_FAMILIES:
        cfg = _recurrent_family_config(tf, arch, common)
    elif arch == "deepseek_v2":  # MLA (latent 32 + rope 16 per token) and grouped-top-k MoE
        cfg = tf.DeepseekV2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                                  kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                  v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4,
                                  moe_intermediate_size=32, num_experts_per_tok=2,
                                  n_shared_experts=1, topk_method="group_limited_greedy",
                                  n_group=2, topk_group=1, max_position_embeddings=512, **common)
    elif arch == "gpt_oss":  # sinks, alternating windows, clamped-SwiGLU experts
        cfg = tf.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention"],
                              max_position_embeddings=512, **common)
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


# NOTE: one set for both sides (factors and mscale): HF 5.x keeps the short factors past the
# original context, where we take the long ones (layers/rotary.py); the mscale is the attention
# factor llama.cpp's converter writes, sqrt(1 + ln(512 / 64) / ln 64), so that its GGUF equals HF
# (scripts/check_llama_cpp_gguf.py). tests/models/test_phimoe.py tells the sets apart.
_PHIMOE_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
                "short_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
                "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
                "short_mscale": 1.5 ** 0.5, "long_mscale": 1.5 ** 0.5}

# HunYuan's checkpoints: "dynamic" with an alpha (fixed NTK-alpha, models/hunyuan.py)
_HUNYUAN_ROPE = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}

_LLAMA4_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

# dense families of issue 35 (tests/engine/test_dense_families.py)
DENSE_FAMILIES = ("phi3", "gemma2", "granite", "glm4", "smollm3", "olmo2", "olmo3", "seed_oss", "cohere",
                  "cohere2", "ministral3", "lfm2", "exaone4", "gemma", "ernie4_5",
                  "hunyuan_v1_dense", "gemma4", "gemma4_e", "gemma3n", "phi", "stablelm", "starcoder2",
                  "gpt_neox", "apertus", "arcee", "helium", "olmo", "nemotron")
DENSE_FAMILIES += ("jais2", "cwm", "vaultgemma", "youtu", "apertus1p5", "bitnet")  # (densec)
DENSE_FAMILIES += ("exaone4_5",)  # (densec: a multimodal checkpoint's text decoder)
MULTIMODAL_TYPES = ("exaone4_5",)  # tiny checkpoints built with AutoModelForImageTextToText


# more MoE families (tests/engine/test_moe_engine.py): 8 experts of width 32, 2 routed per token
MORE_MOE_FAMILIES = ("afmoe", "exaone_moe", "solar_open", "cohere2_moe", "dbrx")


def _more_moe_config(tf, arch: str, common: dict):
    base = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
                max_position_embeddings=512, **common)
    if arch == "afmoe":  # gated attention, sliding RoPE / global NoPE layers, sandwich norms, muP
        return tf.AfmoeConfig(**base, num_experts=8, num_dense_layers=1, num_shared_experts=1, route_scale=2.5,
                              global_attn_every_n_layers=2, sliding_window=6, mup_enabled=True)
    if arch == "exaone_moe":  # q/k norms, sliding RoPE / global NoPE layers, DeepSeek-V3 routing, shared expert
        return tf.ExaoneMoeConfig(**base, num_experts=8, num_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                  topk_group=1, routed_scaling_factor=2.5, sliding_window=6, sliding_window_pattern=2)
    if arch == "solar_open":  # Llama's attention, DeepSeek-V3's grouped sigmoid routing + shared expert everywhere
        return tf.SolarOpenConfig(**{k: v for k, v in base.items() if k != "intermediate_size"}, n_routed_experts=8,
                                  n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5)
    if arch == "cohere2_moe":  # parallel block, interleaved RoPE on sliding (and dense) layers, averaged shared expert
        return tf.Cohere2MoeConfig(**{**base, "intermediate_size": 32}, prefix_dense_intermediate_size=96,
                                   num_experts=8, num_shared_experts=1, first_k_dense_replace=1, sliding_window=6,
                                   sliding_window_pattern=2, logit_scale=0.5)
    if arch == "dbrx":  # bias-free LayerNorms, fused clamped Wqkv, softmax top-k experts renormalized
        return tf.DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=512, **common,
                             attn_config={"kv_n_heads": 2, "clip_qkv": 2.0, "rope_theta": 10000.0},
                             ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 8, "moe_top_k": 2})
    raise ValueError(arch)
DENSE_FAMILIES += ("granite_swa", "minicpm3", "gpt_bigcode", "falcon")


# Hybrid families with recurrent layers: their state in cache entries (layers/recurrent_state.py)
RECURRENT_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "granitemoehybrid", "bamba", "nemotron_h",
                      "falcon_h1", "jamba", "mamba", "falcon_mamba", "mamba2", "kimi_linear")


def _recurrent_family_config(tf, arch: str, common: dict):
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, **common)
    # Gated DeltaNet layers around a gated full-attention layer (a state of 2 cache entries)
    gdn = dict(head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_num_key_heads=2, linear_num_value_heads=4, num_hidden_layers=3,
               layer_types=["linear_attention", "full_attention", "linear_attention"])
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)
    if arch == "qwen3_next":
        return tf.Qwen3NextConfig(**base, **gdn, **moe, intermediate_size=96, decoder_sparse_step=1)
    if arch == "qwen3_5":
        return tf.Qwen3_5TextConfig(**base, **gdn, intermediate_size=96)
    if arch == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig(**base, **gdn, **moe)
    mamba = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4)
    if arch == "bamba":  # Mamba 2 layers around a half-rotary attention layer, SwiGLU MLPs
        return tf.BambaConfig(**base, **mamba, intermediate_size=96, num_hidden_layers=3,
                              attn_layer_indices=[1], mamba_expand=1)
    if arch == "nemotron_h":  # one-mixer blocks: Mamba 2, relu2 MLP, NoPE attention, MoE (latent)
        return tf.NemotronHConfig(**base, head_dim=16, intermediate_size=96, mamba_num_heads=4,
                                  mamba_head_dim=16, ssm_state_size=8, n_groups=1, conv_kernel=4,
                                  layers_block_type=["linear_attention", "mlp", "full_attention", "moe"],
                                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  moe_shared_expert_intermediate_size=48, moe_latent_size=32)
    if arch == "jamba":  # Mamba 1 layers (dt / B / C norms) around a NoPE attention layer, MoE between
        return tf.JambaConfig(**base, intermediate_size=96, num_hidden_layers=3, attn_layer_period=2,
                              attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0,
                              num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                              mamba_expand=1, mamba_dt_rank=8)
    if arch == "kimi_linear":  # KDA layers around a NoPE MLA layer (states in latent pages), V3 experts
        return tf.KimiLinearConfig(
            hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5, linear_head_dim=16,
            linear_num_heads=2, linear_conv_kernel_dim=4, mlp_layer_types=["dense", "sparse", "sparse"],
            layer_types=["linear_attention", "full_attention", "linear_attention"], **common)
    # pure state-space models: no attention layer (the states fit their own page)
    ssm = dict(hidden_size=64, num_hidden_layers=2, state_size=8, conv_kernel=4, **common)
    if arch == "mamba":  # Mamba 1 mixers
        return tf.MambaConfig(**ssm, expand=2, time_step_rank=8)
    if arch == "falcon_mamba":  # Mamba 1 with weightless dt / B / C norms
        return tf.FalconMambaConfig(**ssm, expand=2, time_step_rank=8)
    if arch == "mamba2":  # Mamba 2 mixers, two groups
        return tf.Mamba2Config(**ssm, expand=2, num_heads=8, head_dim=16, n_groups=2, chunk_size=8)
    if arch == "falcon_h1":  # Mamba 2 and attention side by side, muP multipliers
        return tf.FalconH1Config(**base, intermediate_size=96, num_hidden_layers=2, mamba_d_ssm=64,
                                 mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4,
                                 mamba_rms_norm=True, key_multiplier=0.6, ssm_multipliers=[0.9, 1.2, 0.7, 1.4, 0.5],
                                 embedding_multiplier=1.5, lm_head_multiplier=0.7)
    # Granite 4.0-H: Mamba 2 layers around an attention layer, experts and a shared MLP
    return tf.GraniteMoeHybridConfig(
        **base, intermediate_size=32, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=4, mamba_d_head=16, mamba_expand=1, mamba_d_state=8, mamba_n_groups=1,
        mamba_d_conv=4, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
        position_embedding_type="rope", embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=2.5)


# Gemma 4 (31B's layout): sliding layers of 4 KV heads x 16, full ones of 1 x 32 with V = K (each
# sliding layer takes two cache entries: one under TP=2), proportional RoPE on a quarter of the
# full heads
_GEMMA4 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
               attention_k_eq_v=True, sliding_window=6, max_position_embeddings=512,
               layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
               final_logit_softcapping=10.0,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1e6}})


def _dense_family_config(tf, arch: str, common: dict):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, **common)
    if arch == "phi3":  # LongRoPE past 4 positions (served to 512: the long factors), 3/4 rotary
        return tf.Phi3Config(**base, original_max_position_embeddings=4, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0], "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 13.0]})
    if arch == "gemma2":  # [sliding, full], soft-capped
        return tf.Gemma2Config(**base, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                               attn_logit_softcapping=1.5, final_logit_softcapping=4.0)
    if arch == "granite":
        return tf.GraniteConfig(**base, embedding_multiplier=3.0, residual_multiplier=0.5,
                                attention_multiplier=0.2, logits_scaling=2.5)
    if arch == "glm4":
        return tf.Glm4Config(**base, head_dim=16)
    if arch == "smollm3":  # the second layer without RoPE
        return tf.SmolLM3Config(**base, no_rope_layer_interval=2)
    if arch == "olmo3":  # a sliding layer (window 6), then a full one with YaRN
        return tf.Olmo3Config(**base, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                               "full_attention": {"rope_type": "yarn", "factor": 2.0,
                                                                  "rope_theta": 1e4,
                                                                  "original_max_position_embeddings": 256}})
    if arch == "seed_oss":  # q/k/v and MLP biases, none on o
        return tf.SeedOssConfig(**base, head_dim=16, attention_bias=True, attention_out_bias=False,
                                mlp_bias=True)
    if arch == "cohere":  # Command R+'s q/k norms, biases, a power-of-two logit scale
        return tf.CohereConfig(**base, use_qk_norm=True, attention_bias=True, logit_scale=0.25)
    if arch == "cohere2":  # a sliding layer (window 6) with RoPE, then a full one without
        return tf.Cohere2Config(**base, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                                logit_scale=0.5)
    if arch == "ministral3":  # YaRN from 16 positions: the query temperature grows along prompts
        return tf.Ministral3Config(**base, head_dim=16, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.5})
    if arch == "ernie4_5":  # ERNIE 4.5 dense: RoPE on interleaved pairs, every projection biased, tied
        return tf.Ernie4_5Config(**base, head_dim=16, use_bias=True)
    if arch == "hunyuan_v1_dense":  # q/k norms after RoPE, the checkpoints' NTK-alpha RoPE, biases
        return tf.HunYuanDenseV1Config(**base, head_dim=16, attention_bias=True, rope_parameters=_HUNYUAN_ROPE)
    if arch == "gemma":  # Gemma 1: Gemma norms, scaled embeddings, GeLU-gated MLP
        return tf.GemmaConfig(**base, head_dim=16)
    if arch == "exaone4":  # a sliding layer (window 6) with RoPE, then a global one without
        return tf.Exaone4Config(**base, head_dim=16, sliding_window=6,
                                layer_types=["sliding_attention", "full_attention"])
    if arch == "lfm2":  # a conv layer (its state a window of 3 rows in the cache), then attention
        return tf.Lfm2Config(**{**base, "intermediate_size": 192}, layer_types=["conv", "full_attention"],
                             conv_L_cache=3, block_multiple_of=32)
    if arch == "gemma4":
        return tf.Gemma4TextConfig(**_GEMMA4, **common)
    if arch == "gemma4_e":  # E2B's layout: per-layer inputs, the last 2 layers sharing K/V (double-wide MLPs)
        return tf.Gemma4TextConfig(**{**_GEMMA4, "num_key_value_heads": 1, "num_global_key_value_heads": None,
                                      "attention_k_eq_v": False, "hidden_size_per_layer_input": 16,
                                      "vocab_size_per_layer_input": VOCAB, "num_hidden_layers": 6,
                                      "layer_types": ["sliding_attention", "full_attention"] * 3,
                                      "num_kv_shared_layers": 2, "use_double_wide_mlp": True}, **common)
    if arch == "gemma3n":  # E2B's layout: 4 AltUp streams, Laurel, sparse MLPs on the first layers,
        # per-layer inputs (ids past a smaller per-layer table), the last 2 layers sharing K/V
        return tf.Gemma3nTextConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=6, max_position_embeddings=512,
            layer_types=["sliding_attention", "full_attention"] * 3, final_logit_softcapping=10.0,
            hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB - 32, altup_num_inputs=4,
            laurel_rank=8, num_kv_shared_layers=2, activation_sparsity_pattern=[0.95, 0.6] + [0.0] * 4,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "default", "rope_theta": 1e6}}, **common)
    if arch == "phi":  # Phi-2: a parallel block on one LayerNorm, 0.4 of each head rotated, biases
        return tf.PhiConfig(**{**base, "num_key_value_heads": 4}, rope_parameters={
            "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    if arch == "stablelm":  # StableLM 2 12B: parallel block, per-head q/k LayerNorms, 1/4 rotary
        return tf.StableLmConfig(**base, use_parallel_residual=True, qk_layernorm=True, use_qkv_bias=True)
    if arch == "starcoder2":  # LayerNorms with biases, biased projections, a window of 8 on every layer
        return tf.Starcoder2Config(**base, use_bias=True, sliding_window=8)
    if arch == "gpt_neox":  # Pythia: per-head interleaved fused q|k|v, parallel residual, 1/4 rotary
        return tf.GPTNeoXConfig(**{k: v for k, v in base.items() if k != "num_key_value_heads"})
    if arch == "apertus":  # xIELU MLP (learned scalars), q/k norms, Llama 3 RoPE scaling from 16 positions
        return tf.ApertusConfig(**base, head_dim=16, rope_parameters={
            "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 16,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    if arch == "arcee":  # relu^2 non-gated MLP
        return tf.ArceeConfig(**base)
    if arch == "helium":  # fp32-weight RMSNorms, RoPE on interleaved pairs, q/k/v biases
        return tf.HeliumConfig(**base, head_dim=16, attention_bias=True)
    if arch == "olmo":  # weightless LayerNorms, q/k/v clamped
        return tf.OlmoConfig(**base, clip_qkv=1.0)
    if arch == "nemotron":  # layernorm1p, half-rotary RoPE, relu^2 MLP
        return tf.NemotronConfig(**base, head_dim=16)
    if arch == "cwm":  # a full layer, then a sliding one (window 6); Llama 3 RoPE scaling from 16 positions
        return tf.CwmConfig(**base, head_dim=16, sliding_window=6, rope_parameters={
            "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 16,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    if arch == "vaultgemma":  # Gemma 2 without post-norms: [sliding 6, full], soft-capped
        return tf.VaultGemmaConfig(**base, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                                   attn_logit_softcapping=1.5, final_logit_softcapping=4.0)
    if arch == "youtu":  # DeepSeek V3's latent attention (q LoRA, interleaved RoPE), dense MLPs, tied
        return tf.YoutuConfig(**{**base, "num_key_value_heads": 4}, q_lora_rank=24, kv_lora_rank=32,
                              qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
    if arch == "apertus1p5":  # Apertus with a pruned LM head (the last 32 ids never sampled)
        return tf.Apertus1p5TextConfig(**base, head_dim=16, output_vocab_size=VOCAB - 32)
    if arch == "bitnet":  # sub-norms before o_proj / down_proj, relu^2 gated MLP (unquantized)
        return tf.BitNetConfig(**base)
    if arch == "exaone4_5":  # EXAONE 4's decoder (sliding 6 + RoPE, then global NoPE) beside a vision tower
        return tf.Exaone4_5_Config(
            text_config=dict(**base, model_type="exaone4", head_dim=16, sliding_window=6,
                             layer_types=["sliding_attention", "full_attention"]),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, num_key_value_heads=1,
                               out_hidden_size=64, fullatt_block_indexes=[0],
                               rope_parameters={"rope_type": "axial", "rope_theta": 10000.0}),
            image_token_id=VOCAB - 1, video_token_id=VOCAB - 2)
    if arch == "jais2":  # LayerNorms with biases, relu^2 non-gated MLP with biases, biased attention
        return tf.Jais2Config(**base, head_dim=16)
    if arch == "granite_swa":  # Granite with a sliding layer (window 6) and a full NoPE one, sinks
        return tf.GraniteSWAConfig(**_GRANITE_SWA, **common, intermediate_size=128)
    if arch == "falcon":  # Falcon 40B's layout: grouped KV heads, a parallel block on ln_attn / ln_mlp
        return tf.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                               new_decoder_architecture=True, alibi=False, bias=False,
                               max_position_embeddings=512, **common)
    if arch == "gpt_bigcode":  # StarCoder 1: multi-query attention (one KV head), learned positions
        return tf.GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4, n_positions=512, n_inner=128, multi_query=True,
                                   **common)
    if arch == "minicpm3":  # MLA (latent 32 + rope 16, rotate-half), MiniCPM's three multipliers
        return tf.MiniCPM3Config(**{**base, "num_key_value_heads": 4}, q_lora_rank=24, kv_lora_rank=32,
                                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, scale_emb=3.0,
                                 scale_depth=1.4, dim_model_base=16, tie_word_embeddings=False)
    return tf.Olmo2Config(**base)


_GRANITE_SWA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=512, embedding_multiplier=3.0, residual_multiplier=0.5,
                    attention_multiplier=0.2, logits_scaling=2.5, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention"], layer_rope_theta=[1e4, 0],
                    tie_word_embeddings=False)


def make_checkpoint(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random model of `arch` (and the test tokenizer) to `path`; return `path`."""
    from transformers import AutoModelForCausalLM

    cfg = config_for(arch, **overrides)
    torch.manual_seed(seed)
    model = _hf_auto(cfg, AutoModelForCausalLM).from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
            elif arch == "gemma3n" and name.endswith("correct_output_scale"):
                p.normal_(1.0, 0.1)  # (AltUp's scale of the per-layer inputs' gate: 0 would drop them)
            elif arch.startswith("gemma4") and name.endswith(("router.scale", "per_expert_scale")):
                p.normal_(1.0, 0.1)  # (scales of the router's input and of each expert's weight)
            elif "norm" in name or "ln" in name:
                # (Phi-3.5-MoE's LayerNorm biases around 0, as its other biases: around 1 they add
                # one offset shared by every token to the router's input, and its routing flipped
                # more often under Q8_0 noise; GPT-2 / OPT keep theirs)
                centred = arch in ("gemma3", "gemma2", "gemma", "vaultgemma") or (arch == "phimoe" and name.endswith(".bias"))
                p.normal_(0.0 if centred else 1.0, 0.1)
            else:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():  # (a zero buffer at init: drawn so that it moves the choice)
            if (arch in ("minimax_m2", "glm4_moe_lite", "hy_v3", "mimo_v2_flash")
                    and name.endswith("e_score_correction_bias")):
                b.uniform_(0.0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer().save_pretrained(path)
    return path


def load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    from transformers import AutoConfig

    auto = _hf_auto(AutoConfig.from_pretrained(path), AutoModelForCausalLM)
    return auto.from_pretrained(path, dtype=torch.float32).eval()


def _hf_auto(cfg, default):
    """The HF auto class of `cfg`: a multimodal checkpoint's (`MULTIMODAL_TYPES`), else `default`."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText if cfg.model_type in MULTIMODAL_TYPES else default


def tokenizer():
    return _tokenizer()


def make_classifier_checkpoint(path: Path, arch: str, num_labels: int, seed: int = 0) -> Path:
    """Save a tiny random `*ForSequenceClassification` of `arch` with `num_labels` labels (and the
    test tokenizer) to `path`; return `path`."""
    from transformers import AutoModelForSequenceClassification

    cfg = config_for(arch, num_labels=num_labels)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
            else:
                p.normal_(1.0 if "norm" in name or "ln" in name else 0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer().save_pretrained(path)
    return path


def make_lora_adapter(path: Path, base: Path, rank: int, seed: int = 0, *,
                      targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj"), alpha: float | None = None,
                      use_rslora: bool = False, b_std: float = 0.1) -> Path:
    """Save a PEFT LoRA adapter of `rank` over the tiny checkpoint at `base` to `path`
    (safetensors): A as PEFT initializes it, B random (PEFT starts it at zero, which would
    change nothing), both from `seed`; returns `path`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                     target_modules=targets if isinstance(targets, str) else list(targets),
                     lora_dropout=0.0, use_rslora=use_rslora)
    model = get_peft_model(load_hf(base), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf_with_adapter(base: Path, adapter: Path):
    """The tiny HF model at `base` with the PEFT adapter at `adapter` (float32, eval)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf(base), adapter).eval()
