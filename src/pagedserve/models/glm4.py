"""GLM-4 (`Glm4ForCausalLM`, GLM-4-0414) and GLM (`GlmForCausalLM`, glm-4-9b).

Differences from Llama, as in HF 5.x:
- RoPE on the first `partial_rotary_factor` (default 0.5) of each head, in interleaved pairs
  (`layers.rotary`, `interleaved=True`);
- q/k/v projections with a bias (`attention_bias`), the output projection without;
- the MLP's gate and up projections fused in the checkpoint (`mlp.gate_up_proj`, [gate; up]
  rows), split while loading (as Phi-3's, `layers.weights.split_fused_weights`);
- GLM-4 only: two more norms, after attention (`post_self_attn_layernorm`) and after the MLP
  (`post_mlp_layernorm`); its `post_attention_layernorm` is the pre-MLP norm.
NOTE: the fused decode layer rotates halves, not pairs: these layers run their modules.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.weights import split_fused_weights
from pagedserve.models.base import KVCache
from pagedserve.models.llama import (
    FusableDecoderLayer,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    head_dim_of,
)


class GlmDecoderLayer(FusableDecoderLayer):
    """GLM's pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); q/k/v biased, interleaved
    partial RoPE."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        super().__init__()
        eps = config.rms_norm_eps
        head_dim = head_dim_of(config)
        self.self_attn = LlamaAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            scale=head_dim**-0.5, sliding_window=sliding_window,
            qkv_bias=getattr(config, "attention_bias", True), o_bias=False, tp=tp,
            rope_interleaved=True,
        )
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def layer_norms(self) -> tuple:
        return (self.input_layernorm, self.post_attention_layernorm, None, None)

    def unfused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Glm4DecoderLayer(GlmDecoderLayer):
    """GLM-4's sandwich block: x + post_self_attn_norm(attn(input_norm(x))), then
    x + post_mlp_norm(mlp(post_attention_norm(x)))."""

    def __init__(self, config: Any, sliding_window: int | None, **kwargs):
        super().__init__(config, sliding_window, **kwargs)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def layer_norms(self) -> tuple:
        return (self.input_layernorm, self.post_self_attn_layernorm, self.post_attention_layernorm,
                self.post_mlp_layernorm)

    def unfused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        x = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))


class GlmModel(LlamaModel):
    layer_class = GlmDecoderLayer
    rope_interleaved = True


class Glm4Model(GlmModel):
    layer_class = Glm4DecoderLayer


class GlmForCausalLM(LlamaForCausalLM):
    """GLM decoder-only LM on a paged KV cache; the fused `gate_up_proj` split at load."""

    model_class = GlmModel

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        n = self.config.intermediate_size
        fused = {"mlp.gate_up_proj": lambda: [("mlp.gate_proj", n), ("mlp.up_proj", n)]}
        super().load_weights(split_fused_weights(weights, fused))


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM-4 decoder-only LM: GLM with the post-attention and post-MLP norms."""

    model_class = Glm4Model
