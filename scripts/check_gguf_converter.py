"""Check our GGUF loading of the dense families against llama.cpp's real converter.

For each family (phi3, gemma2, granite, glm4, smollm3, olmo2, olmo3, seed_oss, cohere, cohere2,
ministral3, mistral3, lfm2, exaone4, gemma, ernie4_5, hunyuan_v1_dense, the Qwen VL text decoders
qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe; the Gated DeltaNet hybrids qwen3_next, qwen3_5,
qwen3_5_moe; the Mamba2 hybrids granitemoehybrid, bamba, nemotron_h, nemotron_h_moe, falcon_h1;
jamba; the MoEs hunyuan_v1_moe and glm4_moe_lite; the older dense families phi, stablelm, starcoder2,
gpt_neox, olmo, arcee, nemotron, apertus; the pure state-space models mamba, falcon_mamba,
mamba2; gemma3n) this builds a tiny random
HF checkpoint (transformers
`save_pretrained`, with a small tokenizer the converter accepts), converts it with the llama.cpp
tree's `convert_hf_to_gguf.py` to f16 and to Q8_0, and checks that our engine's greedy run of
each GGUF equals our run of the HF folder by vLLM's tie rule (equal tokens up to the first
difference; there each side's token in the other's top 5 logprobs).

    python scripts/check_gguf_converter.py --llama-cpp /work/llama.cpp [--families phi3 gemma2]

Not run by CI (it needs a llama.cpp tree: ../shared/tools/build-llama-server.sh builds one). The
converter recognises BPE tokenizers by a hash of how they split a test text; a tiny tokenizer has
none, so its pre-tokenizer is named ("default") for the conversion -- we never use llama.cpp's
tokenization here: both runs take token ids (`skip_tokenizer_init`).
Exit status 0 when every family and format passes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

VOCAB = 320
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
_SSM = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, state_size=16, conv_kernel=4,
            layer_norm_epsilon=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 8,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                    "llama_4_scaling_beta": 0.5}
_RECURRENT = dict(_COMMON, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
_RECURRENT_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=96)

_HUNYUAN_ROPE = {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}


_GEMMA4 = dict(_COMMON, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
               sliding_window=6, layer_types=["sliding_attention", "full_attention"] * 2,
               final_logit_softcapping=10.0, hidden_size_per_layer_input=0, tie_word_embeddings=True,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1_000_000.0}})


def _qwen_vl(cls, rope_type: str, vision: dict | None = None, **text):
    """A tiny Qwen VL config: M-RoPE sections (interleaved for Qwen3-VL), one vision block."""
    rope = {"rope_type": rope_type, "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    if cls is not transformers.Qwen2VLConfig and cls is not transformers.Qwen2_5_VLConfig:
        rope["mrope_interleaved"] = True
    vision = vision or dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                            out_hidden_size=64, **({} if rope_type == "mrope" else {"num_position_embeddings": 16}))
    return cls(text_config=dict(_COMMON, rope_parameters=rope, **text), vision_config=vision,
               image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3)


FAMILIES = {
    # Phi-4-mini's RoPE: 3/4 of each head, LongRoPE from 16 to 64 positions
    "phi3": lambda: transformers.Phi3Config(
        **_COMMON, original_max_position_embeddings=16,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0],
                         "long_factor": [1.0, 2.0, 3.0, 5.0, 8.0, 13.0]}),
    "gemma2": lambda: transformers.Gemma2Config(**_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=6,
                                                attn_logit_softcapping=1.5, final_logit_softcapping=4.0),
    "gemma": lambda: transformers.GemmaConfig(**_COMMON, head_dim=16),
    "granite": lambda: transformers.GraniteConfig(**_COMMON, embedding_multiplier=3.0, residual_multiplier=0.5,
                                                  attention_multiplier=0.2, logits_scaling=2.5),
    "glm4": lambda: transformers.Glm4Config(**_COMMON, head_dim=16),
    "smollm3": lambda: transformers.SmolLM3Config(**_COMMON),
    "olmo2": lambda: transformers.Olmo2Config(**_COMMON),
    "seed_oss": lambda: transformers.SeedOssConfig(**_COMMON, head_dim=16, attention_bias=True,
                                                   attention_out_bias=False, mlp_bias=True),
    # OLMo 3: written as "olmo2" with sliding windows; YaRN on the full layers only
    "olmo3": lambda: transformers.Olmo3Config(**_COMMON, sliding_window=4, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                           "original_max_position_embeddings": 16}}),
    # Command-R ("command-r") with Command R+'s per-head q/k norms
    "cohere": lambda: transformers.CohereConfig(**_COMMON, use_qk_norm=True, logit_scale=0.0625),
    # Cohere 2 ("cohere2"): HF's default layer types (the converter writes no pattern: llama.cpp's
    # default is the same); its converter reads `rotary_pct`, which HF's config does not define
    "cohere2": lambda: transformers.Cohere2Config(**_COMMON, sliding_window=4, logit_scale=2.0, rotary_pct=1.0),
    # EXAONE 4.0, hybrid: sliding layers with RoPE, every fourth global without
    "exaone4": lambda: transformers.Exaone4Config(**_COMMON, head_dim=16, sliding_window=4,
                                                  sliding_window_pattern=4),
    # Ministral 3: YaRN from 8 positions, so Llama 4's query temperature changes along the prompts
    "ministral3": lambda: transformers.Ministral3Config(**_COMMON, head_dim=16, rope_parameters=_MINISTRAL3_ROPE),
    # Mistral 3 (Ministral 3 / Devstral Small 2 checkpoints): that text decoder under a vision tower
    "mistral3": lambda: transformers.Mistral3Config(
        text_config=transformers.Ministral3Config(**_COMMON, head_dim=16, rope_parameters=_MINISTRAL3_ROPE).to_dict(),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        image_token_index=VOCAB - 1, tie_word_embeddings=False),
    # the Qwen VL text decoders (llama.cpp's qwen2vl, qwen3vl, qwen3vlmoe; the vision tower goes to
    # the mmproj file, not converted here); Qwen3-VL-MoE's experts saved as its released
    # checkpoints store them (`_RELEASED_EXPERT_LAYOUT`)
    "qwen2_vl": lambda: _qwen_vl(transformers.Qwen2VLConfig, "mrope", vision=dict(
        embed_dim=32, depth=1, num_heads=2, hidden_size=64, patch_size=14)),
    "qwen2_5_vl": lambda: _qwen_vl(transformers.Qwen2_5_VLConfig, "mrope"),
    "qwen3_vl": lambda: _qwen_vl(transformers.Qwen3VLConfig, "default", head_dim=16),
    "qwen3_vl_moe": lambda: _qwen_vl(transformers.Qwen3VLMoeConfig, "default", head_dim=16,
                                     moe_intermediate_size=96, num_experts=4, num_experts_per_tok=2),
    # Gated DeltaNet hybrids (llama.cpp's qwen3next, qwen35, qwen35moe): a recurrent state in
    # cache entries; Qwen3.5's value heads twice its key heads (the converter tiles them)
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**_RECURRENT, **_RECURRENT_MOE, decoder_sparse_step=1),
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**_RECURRENT),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**_RECURRENT, **_RECURRENT_MOE),
    # LFM2: short convolutions (state: a window of 3 rows of the cache) around attention layers
    "lfm2": lambda: transformers.Lfm2Config(**{**_COMMON, "intermediate_size": 192}, conv_L_cache=3,
                                            layer_types=["conv", "full_attention", "conv", "conv"],
                                            block_multiple_of=32),
    # Granite 4.0-H: Mamba2 layers (2 groups) around a NoPE attention layer, experts + shared MLP
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        **{**_COMMON, "intermediate_size": 32}, shared_intermediate_size=48, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8,
        mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2,
        position_embedding_type="nope", embedding_multiplier=3.0, residual_multiplier=0.5,
        attention_multiplier=0.2, logits_scaling=2.5),
    # Bamba: Mamba2 layers around a half-rotary attention layer, SwiGLU MLPs ("granitehybrid")
    "bamba": lambda: transformers.BambaConfig(
        **_COMMON, attn_layer_indices=[2], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2),
    # Nemotron-H: Mamba2, relu2 MLP and NoPE attention blocks; with MoE blocks (latent experts)
    "nemotron_h": lambda: transformers.NemotronHConfig(
        **{**_COMMON, "intermediate_size": 96}, head_dim=16, hybrid_override_pattern="M-*M",
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4),
    "nemotron_h_moe": lambda: transformers.NemotronHConfig(
        **{**_COMMON, "intermediate_size": 96}, head_dim=16, hybrid_override_pattern="ME*E",
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, moe_latent_size=32, n_group=2, topk_group=1,
        routed_scaling_factor=1.5),
    # Falcon-H1: a Mamba2 mixer and attention in every layer, muP multipliers (the converter folds
    # them into the weights)
    "falcon_h1": lambda: transformers.FalconH1Config(
        **{**_COMMON, "intermediate_size": 96}, head_dim=16, mamba_d_ssm=96, mamba_n_heads=6,
        mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_rms_norm=True,
        mamba_norm_before_gate=False, embedding_multiplier=1.5, lm_head_multiplier=0.7,
        mlp_multipliers=[0.8, 1.3], key_multiplier=0.6, attention_in_multiplier=1.2,
        attention_out_multiplier=0.9, ssm_in_multiplier=1.1, ssm_out_multiplier=0.8,
        ssm_multipliers=[0.9, 1.2, 0.7, 1.4, 0.5]),
    # Gemma 4: 31B's layout (full layers of one 32-wide KV head, V = K, proportional RoPE; the
    # sliding ones of 2 x 16), 26B-A4B's (experts beside the dense MLP), E2B's (per-layer inputs,
    # the last 2 layers sharing K/V, double-wide MLPs there)
    "gemma4": lambda: transformers.Gemma4TextConfig(**_GEMMA4),
    "gemma4_moe": lambda: transformers.Gemma4TextConfig(**_GEMMA4, enable_moe_block=True, num_experts=4,
                                                        top_k_experts=2, moe_intermediate_size=32),
    "gemma4_e": lambda: transformers.Gemma4TextConfig(**{
        **_GEMMA4, "num_key_value_heads": 1, "num_global_key_value_heads": None, "attention_k_eq_v": False,
        "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": VOCAB, "num_hidden_layers": 6,
        "layer_types": ["sliding_attention", "full_attention"] * 3, "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True}),
    # Gemma 3n: E2B's layout (4 AltUp streams, as the converter asserts; Laurel; sparse MLPs on
    # the first 2 layers; per-layer inputs; the last 2 layers sharing K/V)
    "gemma3n": lambda: transformers.Gemma3nTextConfig(
        **{**_COMMON, "num_hidden_layers": 6}, head_dim=16, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"] * 3, final_logit_softcapping=10.0,
        hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, altup_num_inputs=4,
        laurel_rank=8, num_kv_shared_layers=2, activation_sparsity_pattern=[0.95, 0.6] + [0.0] * 4,
        tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}),
    # Jamba: Mamba 1 layers (dt / B / C norms) around a NoPE attention layer, experts every 2nd
    "jamba": lambda: transformers.JambaConfig(
        **_COMMON, attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8),
    # ERNIE 4.5 dense ("ernie4_5"): RoPE on interleaved pairs (Q/K not permuted), every projection
    # biased, tied embeddings
    "ernie4_5": lambda: transformers.Ernie4_5Config(**_COMMON, head_dim=16, use_bias=True),
    # HunYuan dense / MoE ("hunyuan-dense", "hunyuan-moe"): q/k norms after RoPE, the checkpoints'
    # NTK-alpha RoPE (the converter writes the scaled base; it asserts the released alpha, theta and
    # context, and for the MoE a head of 128), a shared MLP beside softmax top-k experts
    "hunyuan_v1_dense": lambda: transformers.HunYuanDenseV1Config(
        **{**_COMMON, "max_position_embeddings": 32768}, head_dim=16, attention_bias=True, rope_parameters=_HUNYUAN_ROPE),
    "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(
        **{**_COMMON, "max_position_embeddings": 32768, "hidden_size": 256, "num_attention_heads": 2,
           "num_key_value_heads": 1, "intermediate_size": 64}, head_dim=128, num_experts=4, moe_topk=2,
        rope_parameters=_HUNYUAN_ROPE),
    # GLM-4.7-Flash: DeepSeek-V3's MLA (q_lora, interleaved rope) and sigmoid grouped MoE after a
    # dense first layer; llama.cpp writes it as "deepseek2" (its config.json as the hub's: below)
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(
        **{**_COMMON, "num_key_value_heads": 4, "intermediate_size": 96}, moe_intermediate_size=32,
        q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=1.8),
    # the older dense families (models/gguf_classic.py)
    # Phi-2: a parallel block on one LayerNorm, half of each head rotated, an MLP narrower than
    # the 4 x hidden the converter writes (its width read from ffn_up)
    "phi": lambda: transformers.PhiConfig(**{**_COMMON, "num_key_value_heads": 4, "intermediate_size": 96},
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5}),
    # StableLM 2 12B's parallel block; 1.6B's q/k/v biases, sequential. NOTE: not 12B's per-head
    # q/k norms: this tree's converter drops them (conversion/stablelm.py `return`s its stacking
    # generator from inside a generator, never running it: "Unprocessed norms");
    # tests/models/test_gguf_classic.py writes them stacked as the converter means to
    "stablelm": lambda: transformers.StableLmConfig(**_COMMON, use_parallel_residual=True,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     "partial_rotary_factor": 0.25}),
    "stablelm_bias": lambda: transformers.StableLmConfig(**_COMMON, use_qkv_bias=True, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # StarCoder 2 with biases, no sliding window (the converter writes none: llama.cpp attends to
    # the whole context)
    "starcoder2": lambda: transformers.Starcoder2Config(**_COMMON, use_bias=True, sliding_window=None),
    # Pythia: per-head interleaved q|k|v (the converter regroups it), parallel residual, 1/4 rotary
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**{**_COMMON, "num_key_value_heads": 4}, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    # OLMo: weightless LayerNorms, q/k/v clamped, Llama's permuted Q/K
    "olmo": lambda: transformers.OlmoConfig(**_COMMON, clip_qkv=1.0),
    # Arcee: relu^2 MLP, Llama's permuted Q/K
    "arcee": lambda: transformers.ArceeConfig(**_COMMON),
    # Nemotron: layernorm1p (the converter adds 1), half-rotary RoPE, relu^2 MLP
    "nemotron": lambda: transformers.NemotronConfig(**_COMMON, head_dim=16),
    # Apertus: xIELU (its scalars as metadata), q/k norms, Llama 3 RoPE (rope_freqs; 8192 as the
    # original context, what our reader of rope_freqs assumes)
    "apertus": lambda: transformers.ApertusConfig(**_COMMON, head_dim=16, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    # the pure state-space models (no attention): Mamba 1 (llama.cpp runs expand 2 only); Falcon
    # Mamba's dt / B / C norms (llama.cpp runs them with the layers' epsilon: mixer_rms_eps equal);
    # Mamba2 with two groups
    "mamba": lambda: transformers.MambaConfig(**_SSM, expand=2, time_step_rank=8),
    "falcon_mamba": lambda: transformers.FalconMambaConfig(**_SSM, expand=2, time_step_rank=8,
                                                           mixer_rms_eps=1e-5),
    "mamba2": lambda: transformers.Mamba2Config(**_SSM, expand=2, num_heads=8, head_dim=16, n_groups=2),
}
# more MoE families: AfMoE (Arcee Trinity): gated attention, every fourth layer global without
# RoPE (llama.cpp's fixed pattern), sandwich norms, muP (llama.cpp always scales), sigmoid experts
FAMILIES["afmoe"] = lambda: transformers.AfmoeConfig(
    **_COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
    num_dense_layers=1, route_scale=2.5, route_norm=True, sliding_window=4, mup_enabled=True)
# EXAONE MoE: q/k norms, sliding RoPE layers / global NoPE ones, DeepSeek-V3's grouped sigmoid routing
# (its selection bias drawn: SELECTION_BIAS) beside a shared expert after a dense first layer
FAMILIES["exaone_moe"] = lambda: transformers.ExaoneMoeConfig(
    **_COMMON, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
    first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, sliding_window=4,
    sliding_window_pattern=2)
# Solar Open: written as "glm4moe" (no dense layers, no feed_forward_length); its rotated part as the
# rope parameters state it (the converter's default without one is GLM's half)
FAMILIES["solar_open"] = lambda: transformers.SolarOpenConfig(
    **{k: v for k, v in _COMMON.items() if k != "intermediate_size"}, head_dim=16, moe_intermediate_size=32,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0})
# Cohere 2 MoE: Cohere 2's parallel block, a dense first layer (rotated: force_rope), softmax over
# the top-k logits, the shared expert averaged in
FAMILIES["cohere2_moe"] = lambda: transformers.Cohere2MoeConfig(
    **{**_COMMON, "intermediate_size": 32}, head_dim=16, prefix_dense_intermediate_size=96, num_experts=4,
    num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1, sliding_window=4, logit_scale=0.5)
# DBRX: bias-free LayerNorms, the fused Wqkv clamped, softmax top-k experts (stored [E * I, H])
FAMILIES["dbrx"] = lambda: transformers.DbrxConfig(
    d_model=64, n_heads=4, n_layers=4, max_seq_len=64, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
    ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2})
# Jais 2: LayerNorms with biases, relu^2 MLP with biases, biased attention (Q/K not permuted)
FAMILIES["jais2"] = lambda: transformers.Jais2Config(**_COMMON, head_dim=16)
# EXAONE 4.5's text decoder (hybrid: RoPE sliding layers, a NoPE global one); vision tower skipped
FAMILIES["exaone4_5"] = lambda: transformers.Exaone4_5_Config(
    text_config=dict(_COMMON, model_type="exaone4", head_dim=16, sliding_window=4,
                     layer_types=["sliding_attention"] * 3 + ["full_attention"]),
    vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, num_key_value_heads=1,
                       out_hidden_size=64, fullatt_block_indexes=[0],
                       rope_parameters={"rope_type": "axial", "rope_theta": 10000.0}),
    image_token_id=VOCAB - 1, video_token_id=VOCAB - 2)
# Youtu: DeepSeek V3's latent attention (q LoRA, interleaved RoPE), a dense MLP in every layer,
# tied: the converter's "deepseek2" with every block a leading dense one
FAMILIES["youtu"] = lambda: transformers.YoutuConfig(
    **{**_COMMON, "num_key_value_heads": 4}, q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=16)
# BitNet as llama.cpp converts it: the original checkpoints' sub-norm names (inner_attn_ln,
# ffn_layernorm: what the converter maps), SiLU (llama.cpp's graph), tied (no `output` tensor),
# each projection sign(w) * mean|w| (the converter's weight_quant keeps it as it is)
FAMILIES["bitnet"] = lambda: transformers.BitNetConfig(**_COMMON, hidden_act="silu", tie_word_embeddings=True)


def _bitnet_original(folder: Path) -> None:
    import safetensors.torch

    path = folder / "model.safetensors"
    state = {}
    for name, w in safetensors.torch.load_file(path).items():
        if name.endswith("_proj.weight"):
            w = torch.where(w >= 0, 1.0, -1.0).to(w.dtype) * w.abs().mean()
        name = name.replace(".attn_sub_norm.", ".inner_attn_ln.").replace(".ffn_sub_norm.", ".ffn_layernorm.")
        state[name] = w
    safetensors.torch.save_file(state, path, metadata={"format": "pt"})


_POST_SAVE = {"bitnet": _bitnet_original}  # folder rewrites after save_pretrained
# Granite SWA / Granite MoE SWA ("granite_swa"): sinks, sliding layers (window 4) around full ones
_GRANITE_SWA = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                    logits_scaling=2.5, sliding_window=4, tie_word_embeddings=False)
FAMILIES["granite_swa"] = lambda: transformers.GraniteSWAConfig(**_COMMON, **_GRANITE_SWA)
FAMILIES["granitemoe_swa"] = lambda: transformers.GraniteMoeSWAConfig(
    **{**_COMMON, "intermediate_size": 64}, **_GRANITE_SWA, num_local_experts=4, num_experts_per_tok=2,
    shared_intermediate_size=64)
# MiniCPM3: MLA with rotate-half RoPE; llama.cpp fixes scale_emb 12, scale_depth 1.4,
# dim_model_base 256 and the value width hidden / heads (the converter writes none of them)
FAMILIES["minicpm3"] = lambda: transformers.MiniCPM3Config(
    **{**_COMMON, "num_key_value_heads": 4}, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=16, v_head_dim=16, scale_emb=12.0, scale_depth=1.4, dim_model_base=256)
# Laguna: per-layer query heads, softplus head gates, llama.cpp's layer pattern (every fourth layer
# full, from the first: the converter writes none), a dense first layer, sigmoid-routed experts
FAMILIES["laguna"] = lambda: transformers.LagunaConfig(
    **{**_COMMON, "intermediate_size": 128}, head_dim=16, num_attention_heads_per_layer=[8, 4, 4, 4],
    sliding_window=4, layer_types=["full_attention"] + ["sliding_attention"] * 3,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=64, shared_expert_intermediate_size=64, moe_routed_scaling_factor=2.5)
# HunYuan V3: q/k norms; a dense first layer, sigmoid-routed experts (selection bias) + shared MLP
FAMILIES["hy_v3"] = lambda: transformers.HYV3Config(
    **_COMMON, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    router_scaling_factor=2.5)
# GPT-BigCode (StarCoder 1): multi-query attention, learned positions ("starcoder")
FAMILIES["gpt_bigcode"] = lambda: transformers.GPTBigCodeConfig(
    vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=64, multi_query=True,
    pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Falcon 40B's layout: grouped KV heads and two LayerNorms (llama.cpp's fixed context
# of 2048 and RoPE base 10000: the HF configs' defaults here)
FAMILIES["falcon"] = lambda: transformers.FalconConfig(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_kv_heads=2,
    new_decoder_architecture=True, alibi=False, bias=False, max_position_embeddings=2048,
    pad_token_id=0, bos_token_id=1, eos_token_id=2)
# MiMo-V2-Flash: a full layer, then sliding ones (twice the KV heads, sinks), q/k heads of 32 and
# value heads of 16 (the converter reads the hub's config keys: below), DeepSeek-V3-routed experts
FAMILIES["mimo_v2_flash"] = lambda: transformers.MiMoV2FlashConfig(
    **{**_COMMON, "num_attention_heads": 8, "intermediate_size": 128}, head_dim=32, v_head_dim=32,
    moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
    sliding_window=4, layer_types=["full_attention"] + ["sliding_attention"] * 3, attention_value_scale=0.5)
# NOTE: no Falcon 7B (one KV head): under transformers 5 the converter reads FalconConfig's
# num_kv_heads, which the config fills with the head count, and fails on the multi-query q/k/v
# (tests/models/test_falcon.py writes its file as the converter does with n_head_kv 1)
MULTIMODAL = {"mistral3": "Mistral3ForConditionalGeneration", "qwen2_vl": "Qwen2VLForConditionalGeneration",
              "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration",
              "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}  # HF classes of the multimodal ones
MULTIMODAL["exaone4_5"] = "Exaone4_5_ForConditionalGeneration"
_RELEASED_EXPERT_LAYOUT = ("qwen3_vl_moe",)  # fused experts saved [E, H, 2I] / [E, I, H]
SENTENCEPIECE = ("gemma2", "gemma", "jamba", "ernie4_5", "nemotron")  # converters that read tokenizer.model only
SENTENCEPIECE += ("bitnet",)
SELECTION_BIAS = ("glm4_moe_lite",)  # families whose router's correction bias is drawn too
SELECTION_BIAS += ("exaone_moe", "solar_open")
# converters that look up more special tokens (Solar Open's: its bos / unk)
EXTRA_SPECIAL_TOKENS = {"solar_open": ["<unk>", "<|startoftext|>"]}
SENTENCEPIECE += ("minicpm3",)
SELECTION_BIAS += ("hy_v3", "mimo_v2_flash")
GLM_SPECIAL_TOKENS = ("glm4_moe_lite",)  # converters that want GLM's [gMASK] / <|observation|>
# config.json as the hub's checkpoints write it where transformers 5 saves it otherwise: Granite
# 4.0-H's layer types as "mamba" / "attention" (the converter finds its attention layers by those)
# Bamba: its rotated part as the hub's configs state it (HF's config fixes it at half a head)
_HUB_CONFIG_BAMBA = lambda c: {**c, "attn_rotary_emb": c["hidden_size"] // c["num_attention_heads"] // 2}  # noqa: E731
_NEMOTRON_PATTERN = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
_HUB_CONFIG = {"granitemoehybrid": lambda c: {**c, "layer_types": [
    "mamba" if t in ("mamba", "linear_attention") else "attention" for t in c["layer_types"]]}}
_HUB_CONFIG["bamba"] = _HUB_CONFIG_BAMBA
# MiMo-V2-Flash: the hub's config.json names the sliding layers' sizes and pattern on their own
_HUB_CONFIG["mimo_v2_flash"] = lambda c: {
    **c, "hybrid_layer_pattern": [int(t == "sliding_attention") for t in c["layer_types"]],
    "swa_num_key_value_heads": 2 * c["num_key_value_heads"], "swa_head_dim": c["head_dim"],
    "swa_num_attention_heads": c["num_attention_heads"], "swa_v_head_dim": c["v_head_dim"],
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "layernorm_epsilon": c["rms_norm_eps"]}
# GLM-4.7-Flash: the hub's config.json names the dense first layer as DeepSeek's do
# (`first_k_dense_replace`, which the converter writes as leading_dense_block_count; transformers
# 5 saves `mlp_layer_types` only)
# Hunyuan-A13B: its per-layer MoE lists as the hub's config.json gives them (the converter reads
# moe_intermediate_size, moe_topk and num_shared_expert as lists)
_HUB_CONFIG["hunyuan_v1_moe"] = lambda c: {
    **c, "moe_topk": [c["moe_topk"]] * c["num_hidden_layers"],
    "moe_intermediate_size": [c["intermediate_size"]] * c["num_hidden_layers"],
    "num_shared_expert": [1] * c["num_hidden_layers"]}
_HUB_CONFIG["glm4_moe_lite"] = lambda c: {**c, "first_k_dense_replace": c["mlp_layer_types"].index("sparse")}
# Nemotron-H: the pattern string ("M-*M"), not the list transformers 5 saves; a dense one without
# the MoE keys (the converter takes `num_experts_per_tok` for "this is nemotron_h_moe")
_HUB_CONFIG["nemotron_h_moe"] = lambda c: {
    **{k: v for k, v in c.items() if k != "layers_block_type"},
    "hybrid_override_pattern": "".join(_NEMOTRON_PATTERN[t] for t in c["layers_block_type"])}
_HUB_CONFIG["nemotron_h"] = lambda c: {
    k: v for k, v in _HUB_CONFIG["nemotron_h_moe"](c).items()
    if not k.startswith(("moe_", "n_routed", "num_experts", "n_shared"))
    and k not in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob")}
# the converter, with the tiny tokenizer's pre-tokenizer named (see the module docstring)
_RUN_CONVERTER = """
import sys
sys.path.insert(0, sys.argv[1])
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py"] + sys.argv[2:]
import convert_hf_to_gguf
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
from conversion import hunyuan  # (Hunyuan-A13B's reads a tiktoken model: the tiny BPE instead)
hunyuan.HunYuanMoEModel.set_vocab = base.TextModel._set_vocab_gpt2
# GPT-NeoX: the converter reads `rotary_pct` from the config transformers loads, whose 5.x
# GPTNeoXConfig moves it into rope_parameters (a KeyError on every checkpoint, hub ones too)
from conversion import gptneox
_neox_params = gptneox.GPTNeoXModel.set_gguf_parameters
def _neox_with_rotary_pct(self):
    self.hparams.setdefault("rotary_pct", self.rope_parameters.get("partial_rotary_factor", 0.25))
    _neox_params(self)
gptneox.GPTNeoXModel.set_gguf_parameters = _neox_with_rotary_pct
# MiMo-V2-Flash: the converter reads rope_parameters["partial_rotary_factor"], which transformers
# 5's MiMoV2FlashConfig nests per layer type (a KeyError on every checkpoint): the full layers' at
# the top, the sliding ones' kept for the base class's rope.freq_base_swa
from conversion import mimo
_mimo_params = mimo.MimoV2Model.set_gguf_parameters
def _mimo_with_flat_rope(self):
    if "full_attention" in self.rope_parameters:
        self.rope_parameters = {**self.rope_parameters, **self.rope_parameters["full_attention"]}
    _mimo_params(self)
mimo.MimoV2Model.set_gguf_parameters = _mimo_with_flat_rope
convert_hf_to_gguf.main()
"""


def _corpus() -> str:
    from pagedserve.bench.trace import corpus_text

    return corpus_text()[:100_000]


def save_tokenizer(folder: Path, family: str) -> None:
    """A small tokenizer the family's converter reads: SentencePiece (tokenizer.model) or a
    byte-level BPE saved as a GPT-2 tokenizer, with GLM's `<|endoftext|>` / `<|user|>` (and
    `[gMASK]` / `<|observation|>` for `GLM_SPECIAL_TOKENS`)."""
    if family in SENTENCEPIECE:
        import sentencepiece as spm

        text = folder / "corpus.txt"
        text.write_text(_corpus())
        spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "tokenizer"),
                                       vocab_size=VOCAB - 8, model_type="bpe", pad_id=0, bos_id=1,
                                       eos_id=2, unk_id=3, minloglevel=2)
        text.unlink()
        (folder / "tokenizer.vocab").unlink()
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # (Gemma 4's converter reads a tokenizer.json only as Llama's: byte fallback, a decoder
    # sequence; what they change does not matter to token ids)
    llama_json = family.startswith("gemma4")
    tok = Tokenizer(models.BPE(byte_fallback=llama_json))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.Sequence([decoders.ByteLevel()]) if llama_json else decoders.ByteLevel()
    special = ["<pad>", "<s>", "<|endoftext|>", "<|user|>"]
    if family in GLM_SPECIAL_TOKENS:  # (the converter's _set_vocab_glm looks these up too)
        special += ["[gMASK]", "<|observation|>"]
    special += EXTRA_SPECIAL_TOKENS.get(family, [])
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_corpus()], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|endoftext|>",
                                   pad_token="<pad>")
    fast.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"  # Phi-3's converter takes the BPE path for it
    config_path.write_text(json.dumps(config, indent=2))


def make_checkpoint(folder: Path, family: str, seed: int = 0) -> Path:
    """A tiny random `family` checkpoint (weights N(0, 0.15), norms around their identity)."""
    config = FAMILIES[family]()
    torch.manual_seed(seed)
    if family in MULTIMODAL:
        model = getattr(transformers, MULTIMODAL[family])(config).float()
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
            elif "norm" in name or name.endswith("altup.correct_output_scale"):  # (Gemma 3n: around 1)
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (0.0 if family in ("gemma2", "gemma") else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        for name, b in model.named_buffers():  # (zero at init: drawn so that it moves the choice)
            if family in SELECTION_BIAS and name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if family in _RELEASED_EXPERT_LAYOUT:  # transformers 5 saves its modules' [E, 2I, H] / [E, H, I]
        import safetensors.torch

        state = safetensors.torch.load_file(folder / "model.safetensors")
        for name in [n for n in state if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
            state[name] = state[name].transpose(1, 2).contiguous()
        safetensors.torch.save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    if family in _POST_SAVE:
        _POST_SAVE[family](folder)
    if family in _HUB_CONFIG:
        path = folder / "config.json"
        path.write_text(json.dumps(_HUB_CONFIG[family](json.loads(path.read_text())), indent=2))
    save_tokenizer(folder, family)
    return folder


# converter flags per family: the tiny Qwen3-Next / 3.5 checkpoints carry no multi-token
# prediction layers (the released ones do; the converter expects them unless told)
CONVERT_FLAGS = {"qwen3_next": ["--no-mtp"], "qwen3_5": ["--no-mtp"], "qwen3_5_moe": ["--no-mtp"]}
CONVERT_FLAGS["mimo_v2_flash"] = ["--no-mtp"]  # (the converter assumes the hub's 3 MTP layers)


def convert(llama_cpp: Path, folder: Path, outtype: str, out: Path, flags=()) -> Path:
    """Run the tree's convert_hf_to_gguf.py (in its own process: its gguf-py stays out of ours)."""
    cmd = [sys.executable, "-c", _RUN_CONVERTER, str(llama_cpp), str(folder), "--outtype", outtype,
           "--outfile", str(out), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({outtype}):\n{done.stderr[-3000:]}")
    return out


def greedy_run(path: Path, prompts: list[list[int]], **engine) -> list[tuple[list[int], list[dict]]]:
    """Our engine's greedy tokens and top-5 logprobs for each prompt."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(path), skip_tokenizer_init=True, kv_cache_memory=1 << 24, block_size=4, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for out in outs:
        c = out.outputs[0]
        results.append((list(c.token_ids), [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs]))
    del llm
    return results


def tie_rule(ours, ref) -> str | None:
    """None when `ours` equals `ref` by vLLM's tie rule, else what differs."""
    (a_tok, a_lp), (b_tok, b_lp) = ours, ref
    for i, (x, y) in enumerate(zip(a_tok, b_tok)):
        if x == y:
            continue
        if x in b_lp[i] and y in a_lp[i]:
            return None
        return f"position {i}: {x} vs {y} is not a near-tie ({a_tok} vs {b_tok})"
    return None if len(a_tok) == len(b_tok) else "lengths differ"


# Families whose q8_0 file is compared with our run of the HF folder on the weights Q8_0 rounds
# them to (`q8_0_rounded`), its products taking x as it is: the tiny random Gated DeltaNet MoEs
# (and Qwen3.5) flip a routing choice or a token on Q8_0's noise alone -- against the unrounded
# HF run Qwen3-Next and Qwen3.5-MoE diverge where no near-tie is, against the rounded one all
# three are token-identical.
Q8_ROUNDED_REFERENCE = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "glm4_moe_lite", "hunyuan_v1_moe")
Q8_ROUNDED_REFERENCE += ("hy_v3",)  # (HunYuan V3: sigmoid routing with a selection bias)
# ... and their f16 file with the HF folder's weights rounded to f16 (`f16_rounded`): GLM-4.7-Flash's
# tiny random model flips a choice of its sigmoid router (scores plus the selection bias) on
# f16's rounding alone (its f32 file gives the HF folder's logits exactly), Hunyuan-A13B's a
# near-tied token (by the tie rule against the unrounded folder; 3/3 identical to the rounded one)
Q8_ROUNDED_REFERENCE += ("solar_open", "dbrx")  # (tiny random Solar Open, DBRX: 0/3 token-identical to the unrounded run)
F16_ROUNDED_REFERENCE = ("glm4_moe_lite", "hunyuan_v1_moe")


# what the converter keeps in F32 whatever the outtype: the routers (ffn_gate_inp: HunYuan's
# `mlp.gate.wg`), the shared-expert gates, the convolutions
_F32_KEPT = ("mlp.gate.weight", "mlp.gate.wg.weight", "shared_expert_gate.weight", "conv1d.weight")
_F32_KEPT += ("mlp.router.gate.weight",)  # (HunYuan V3's router: F32 in the file too)


def _q8_0_round(x: torch.Tensor) -> torch.Tensor:
    """`x` as the converter's q8_0 stores it: Q8_0 blocks of 32 along the rows, or F16 where a
    row is not a whole number of blocks (the converter's fallback)."""
    import gguf

    if x.shape[-1] % 32:
        return x.half().float()
    q8 = gguf.GGMLQuantizationType.Q8_0
    rows = x.reshape(-1, x.shape[-1]).numpy()
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(rows, q8), q8)).reshape(x.shape)


def _mla_kv_b_rounded(w: torch.Tensor, cfg: dict, round_rows) -> torch.Tensor:
    """DeepSeek's `kv_b_proj` `[H * (nope + v), r]` as the converter stores it: `attn_k_b`
    `[H, r, nope]` (transposed, rounded along nope) and `attn_v_b` `[H, v, r]`."""
    nope = cfg["qk_nope_head_dim"]
    kv = w.float().reshape(cfg["num_attention_heads"], nope + cfg["v_head_dim"], -1)
    k = round_rows(kv[:, :nope].transpose(1, 2).contiguous()).transpose(1, 2)
    return torch.cat((k, round_rows(kv[:, nope:].contiguous())), dim=1).reshape(w.shape)


def f16_rounded(folder: Path, family: str, out: Path) -> Path:
    """A copy of the checkpoint at `folder` with every 2-D weight but `_F32_KEPT` rounded to f16,
    as llama.cpp's f16 conversion stores them."""
    import shutil

    import safetensors.torch

    shutil.copytree(folder, out, dirs_exist_ok=True)
    state = safetensors.torch.load_file(out / "model.safetensors")
    for name, w in state.items():
        if w.dim() >= 2 and not name.endswith(_F32_KEPT):
            state[name] = w.half().to(w.dtype)
    safetensors.torch.save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def q8_0_rounded(folder: Path, family: str, out: Path) -> Path:
    """A copy of the checkpoint at `folder` with every 2-D weight rounded as llama.cpp's q8_0
    conversion stores it (blocks of 32 along the input features, F16 where a row is no whole
    number of blocks; `_F32_KEPT` kept in F32; MLA's kv_b_proj as its attn_k_b / attn_v_b halves;
    Qwen3.5's out_proj in the converter's tiled value-head
    column order)."""
    import shutil

    import safetensors.torch

    shutil.copytree(folder, out, dirs_exist_ok=True)
    state = safetensors.torch.load_file(out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    hk, hv = cfg.get("linear_num_key_heads", 1), cfg.get("linear_num_value_heads", 1)
    tiled = torch.arange(hv * cfg.get("linear_value_head_dim", 1)).reshape(hk, hv // hk, -1)
    tiled = tiled.permute(1, 0, 2).reshape(-1)  # the converter's value-head order
    for name, w in state.items():
        if w.dim() < 2 or name.endswith(_F32_KEPT):
            continue
        if name.endswith("self_attn.kv_b_proj.weight"):  # MLA: split as the converter stores it
            state[name] = _mla_kv_b_rounded(w, cfg, _q8_0_round).to(w.dtype)
            continue
        permute = family.startswith("qwen3_5") and name.endswith("linear_attn.out_proj.weight")
        x = w.float()[:, tiled] if permute else w.float()
        r = _q8_0_round(x)
        if permute:
            r = torch.empty_like(r).index_copy_(1, tiled, r)
        state[name] = r.to(w.dtype)
    safetensors.torch.save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def check_family(llama_cpp: Path, family: str, work: Path) -> list[str]:
    """Problems found for `family` (empty: both formats pass)."""
    folder = make_checkpoint(work / family, family)
    gen = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(4, VOCAB - 8, (n,), generator=gen).tolist() for n in (5, 12, 21)]
    reference = greedy_run(folder, prompts, dtype="float32")
    problems = []
    for outtype in ("f16", "q8_0"):
        path = convert(llama_cpp, folder, outtype, work / f"{family}-{outtype}.gguf",
                       CONVERT_FLAGS.get(family, ()))
        ref_runs = reference
        if outtype == "q8_0" and family in Q8_ROUNDED_REFERENCE:
            rounded = q8_0_rounded(folder, family, work / f"{family}-q8_0-rounded")
            ref_runs = greedy_run(rounded, prompts, dtype="float32")
            runs = greedy_run(path, prompts, dtype="float32", gguf_activations="dtype")
        elif outtype == "f16" and family in F16_ROUNDED_REFERENCE:
            rounded = f16_rounded(folder, family, work / f"{family}-f16-rounded")
            ref_runs = greedy_run(rounded, prompts, dtype="float32")
            runs = greedy_run(path, prompts, dtype="float32")
        else:
            runs = greedy_run(path, prompts, dtype="float32" if outtype == "f16" else "auto")
        for i, (ours, ref) in enumerate(zip(runs, ref_runs)):
            if (why := tie_rule(ours, ref)) is not None:
                problems.append(f"{family} {outtype} prompt {i}: {why}")
        same = sum(o[0] == r[0] for o, r in zip(runs, ref_runs))
        print(f"{family:8s} {outtype:5s} {'ok' if not problems else 'FAIL'}: "
              f"{same}/{len(prompts)} prompts token-identical to the HF-folder run", flush=True)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp source tree")
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--work", type=Path, default=None, help="keep the checkpoints and GGUFs here")
    args = parser.parse_args(argv)
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        parser.error(f"--llama-cpp: no convert_hf_to_gguf.py in {args.llama_cpp}")
    with tempfile.TemporaryDirectory(prefix="gguf-converter-check-") as tmp:
        work = args.work or Path(tmp)
        problems = []
        for family in args.families:
            try:
                problems += check_family(args.llama_cpp, family, work)
            except Exception as e:  # report every family, then fail
                problems.append(f"{family}: {type(e).__name__}: {e}")
                print(f"{family:8s} ERROR: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    for p in problems:
        print("FAIL", p)
    print("all passed" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
