"""MiniCPM3 (`MiniCPM3ForCausalLM`, MiniCPM3-4B): a dense decoder with DeepSeek V2's multi-head
latent attention (`layers.mla.MLAttention`) and MiniCPM's three multipliers.

Differences from DeepSeek V2 (dense layers only), as in HF 5.x:
- RoPE in the rotate-half layout (HF's `apply_rotary_pos_emb`), not on interleaved pairs; the
  softmax scale `qk_head_dim ** -0.5` (YaRN's mscale where the config names one);
- embeddings times `scale_emb`;
- each residual branch times `scale_depth / sqrt(num_hidden_layers)`;
- the final hidden states divided by `hidden_size / dim_model_base` before the LM head (HF's
  `logits_scaling`), here in `final` so that every logits path sees HF's LM-head input.
A config with routed experts (`n_routed_experts`) is not MiniCPM3's: ValueError.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.kv_spec import MLASpec
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import VocabParallelEmbedding
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.models.base import DecoderStack, KVCache, KVCacheSpec, PagedCausalLM
from pagedserve.models.deepseek_v2 import DeepseekV2DecoderLayer, DeepseekV2ForCausalLM, DeepseekV2Model


class MiniCPM3DecoderLayer(DeepseekV2DecoderLayer):
    """DeepSeek V2's dense block (MLA, gated MLP) with each residual branch times
    `scale_depth / sqrt(num_hidden_layers)`."""

    def __init__(self, config: Any, index: int, *, tp: TPContext = SINGLE):
        super().__init__(config, index, tp=tp)
        self.residual_scale = float(config.scale_depth) / math.sqrt(config.num_hidden_layers)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta) * self.residual_scale
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_scale


class MiniCPM3Model(DeepseekV2Model):
    """Embeddings (times `scale_emb`), MiniCPM3 layers, the final norm (then divided by
    `hidden_size / dim_model_base`)."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        DecoderStack.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(MiniCPM3DecoderLayer(config, i, tp=tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, rope_parameters(config),
                                          config.max_position_embeddings)
        self.scale_emb = float(config.scale_emb)
        base = getattr(config, "dim_model_base", None) or config.hidden_size
        self.logits_scaling = config.hidden_size / base

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x, extras = super().embed(input_ids, positions)
        return x * self.scale_emb, extras  # [T, H]

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.norm(x) / self.logits_scaling


class MiniCPM3ForCausalLM(DeepseekV2ForCausalLM):
    """MiniCPM3 on a paged latent cache (`MLASpec(kv_lora_rank + qk_rope_head_dim)` on every
    layer, as DeepSeek V2's); see the module docstring."""

    tied_by_default = True

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        PagedCausalLM.__init__(self)
        if getattr(config, "n_routed_experts", None):
            raise ValueError(f"MiniCPM3 with n_routed_experts={config.n_routed_experts} is not supported")
        if getattr(config, "rope_interleave", False):
            raise ValueError("MiniCPM3 with rope_interleave=True is not supported (HF rotates halves)")
        config.rope_interleave = False  # (read by the MLA layers)
        self.expert_parallel = False
        self.model = MiniCPM3Model(config, tp=tp)
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size, num_kv_heads=1,
                        head_dim=latent, tp=tp)
        n = config.num_hidden_layers
        self.kv_cache_spec = KVCacheSpec(n, 1, latent, layers=(MLASpec(latent),) * n)
        self._placement = None
