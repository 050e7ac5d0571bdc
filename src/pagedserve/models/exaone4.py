"""EXAONE 4.0 (`Exaone4ForCausalLM`, LG AI Research): the Llama decoder with post-norms, per-head
q/k norms and, in its hybrid form, sliding-window layers with RoPE and global layers without.

Differences from Llama, as in HF 5.x:
- no norm before attention or the MLP: each branch's output is RMS-normalised (Llama's numerics)
  before it is added (`post_attention_layernorm`, `post_feedforward_layernorm`), as OLMo 2's;
- q and k RMS-normalised per head (`q_norm`, `k_norm` of head_dim) before RoPE;
- with `sliding_window` set, `layer_types[i]` picks a sliding-window layer (RoPE) or a global one
  with no position embedding at all (NoPE: the identity rotation, `q * 1 + rotate(q) * 0` is q
  bit for bit); without it, every layer is global with RoPE.
The layers run their modules (the fused decode kernel has pre-norms only).
llama.cpp writes it as architecture "exaone4" (`models.gguf_config`).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.norms import RMSNorm
from pagedserve.models.base import KVCache
from pagedserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, layer_sliding_windows
from pagedserve.models.smollm3 import identity_rope_for


class Exaone4DecoderLayer(LlamaDecoderLayer):
    """Post-norm block: x + post_attn_norm(attn(x)), then x + post_ff_norm(mlp(x)); per-head
    q/k norms in the attention."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        super().__init__(config, sliding_window, qkv_bias=qkv_bias, qk_norm=True, tp=tp)
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.unfused(x, rope, kv_cache, meta)

    def unfused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta))  # [T, H]
        return x + self.post_feedforward_layernorm(self.mlp(x))


def exaone4_rope_layers(config: Any) -> list[bool]:
    """Whether each layer applies RoPE: all when `sliding_window` is None, else the sliding ones."""
    if getattr(config, "sliding_window", None) is None:
        return [True] * config.num_hidden_layers
    return [w is not None for w in layer_sliding_windows(config)]


class Exaone4Model(LlamaModel):
    """Llama's stack of EXAONE 4.0 layers; the global layers of a hybrid model get identity
    cos/sin tables."""

    layer_class = Exaone4DecoderLayer

    def __init__(self, config: Any, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.use_rope = exaone4_rope_layers(config)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x, extras = super().embed(input_ids, positions)
        return x, identity_rope_for(extras, self.use_rope)


class Exaone4ForCausalLM(LlamaForCausalLM):
    """EXAONE 4.0 decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = Exaone4Model

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        if getattr(config, "sliding_window", None) is None:
            return [None] * config.num_hidden_layers
        return layer_sliding_windows(config)
