"""Cohere Command-R (`CohereForCausalLM`: Command R, Command R+, Aya 23), and the pieces Cohere 2
(`models.cohere2`) reuses.

Differences from Llama, as in HF 5.x:
- Cohere's LayerNorm: mean-subtracted, a weight and no bias, statistics and the weight's product
  in float32 (`layer_norm_eps`);
- a parallel block: one input norm feeds both branches, `x + attn(ln(x)) + mlp(ln(x))`;
- RoPE on interleaved pairs (2i with 2i + 1: HF's `repeat_interleave` tables, `layers.rotary`
  with `interleaved=True`), q and k rotated in float32 and cast back, as HF's;
- `use_qk_norm`: q and k through Cohere's LayerNorm per head (over head_dim) before RoPE, its
  weight one row per head (`[heads, head_dim]`; Command R+);
- `attention_bias` on q / k / v and o alike; logits multiplied by `logit_scale`; tied head.
From GGUF: llama.cpp's "command-r" (its Q/K rows as HF's, not permuted).
NOTE: the fused decode layer (`platforms.cpu_decode`) runs pre-norm RMSNorm blocks only: these
layers are not `FusableDecoderLayer`s and always run their modules (decode included).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import ShardSpec, set_shard
from pagedserve.layers.rotary import apply_rotary, rope_parameters
from pagedserve.models.base import KVCache
from pagedserve.models.granite import LogitsScaling
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, head_dim_of


def check_cohere_config(config: Any) -> None:
    """ValueError for what HF's Cohere layers ignore but our RoPE would apply: a
    `partial_rotary_factor` (HF's Cohere rotates whole heads)."""
    partial = rope_parameters(config).get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ValueError(f"Cohere with partial_rotary_factor {partial} is not supported (HF's Cohere "
                         "rotates whole heads)")


class CohereLayerNorm(nn.Module):
    """HF's `CohereLayerNorm`: `weight * (x - mean) / sqrt(var + eps)` over the last dimension in
    float32, cast back to the input dtype; no bias. `shape` is the hidden size, or
    `(heads, head_dim)` for the per-head q/k norms (one weight row per head); `shard`: the part of
    the checkpoint's weight this rank holds (its heads under tensor parallelism)."""

    def __init__(self, shape: int | tuple[int, ...], eps: float, *, shard: ShardSpec | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps
        if shard is not None:
            set_shard(self.weight, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] (or [T, heads, D]) -> same
        x32 = x.float()
        mean = x32.mean(-1, keepdim=True)  # [..., 1]
        var = (x32 - mean).pow(2).mean(-1, keepdim=True)  # [..., 1]
        x32 = (x32 - mean) * torch.rsqrt(var + self.eps)
        return (self.weight.float() * x32).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def head_rows_shard(tp: TPContext, local: int, part: tuple[int, int], total: int) -> ShardSpec | None:
    """The shard of a per-head norm weight `[total heads, D]` whose `local` heads are part
    `part = (index, count)` (`TPContext.kv_head_part`), or None on one rank."""
    if not tp.is_parallel:
        return None
    start = part[0] * local
    return ShardSpec(0, ((start, start + local),), total)


class CohereAttention(LlamaAttention):
    """Llama's attention (grouped KV heads, paged cache) with Cohere's optional per-head
    LayerNorm on q / k, interleaved RoPE in float32, or no RoPE at all (`use_rope=False`:
    Cohere 2's full-attention layers)."""

    def __init__(self, config: Any, sliding_window: int | None, *, qk_norm: bool, use_rope: bool,
                 tp: TPContext = SINGLE):
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                         scale=head_dim**-0.5, sliding_window=sliding_window, qkv_bias=bias, o_bias=bias,
                         tp=tp, rope_interleaved=True)
        self.use_rope = use_rope
        if qk_norm:
            eps = config.layer_norm_eps
            heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
            self.q_norm = CohereLayerNorm(
                (self.num_heads, head_dim), eps,
                shard=head_rows_shard(tp, self.num_heads, (tp.rank, tp.world_size), heads))
            self.k_norm = CohereLayerNorm(
                (self.num_kv_heads, head_dim), eps,
                shard=head_rows_shard(tp, self.num_kv_heads, tp.kv_head_part(kv_heads), kv_heads))

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, D] (interleaved pairs)
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        q, k, v = self.qkv_heads(x)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            # NOTE: in float32 and cast back once, as HF's Cohere `apply_rotary_pos_emb` (the
            # activation-dtype rotation of `norm_and_rotate` rounds each product in bf16)
            cos, sin = rope
            q32, k32 = apply_rotary(q.float(), k.float(), cos.float(), sin.float(), interleaved=True)
            q, k = q32.to(q.dtype), k32.to(k.dtype)  # [T, Hq, D], [T, Hkv, D]
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))  # [T, H]


class CohereDecoderLayer(nn.Module):
    """Cohere's parallel block: `x + attn(ln(x)) + mlp(ln(x))` with one LayerNorm.
    Built as `LlamaModel` builds its layers (`qkv_bias` comes from the config's
    `attention_bias`; `qk_norm` from `use_qk_norm`, see `uses_qk_norm`)."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        super().__init__()
        self.self_attn = CohereAttention(config, sliding_window, qk_norm=self.uses_qk_norm(config),
                                         use_rope=self.uses_rope(sliding_window), tp=tp)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        self.input_layernorm = CohereLayerNorm(config.hidden_size, config.layer_norm_eps)

    @staticmethod
    def uses_qk_norm(config: Any) -> bool:
        """Whether the layer's attention normalises q and k (Cohere: `use_qk_norm`)."""
        return bool(getattr(config, "use_qk_norm", False))

    @staticmethod
    def uses_rope(sliding_window: int | None) -> bool:
        """Whether a layer with this window rotates q and k (Cohere: every layer)."""
        return True

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        h = self.input_layernorm(x)  # [T, H]
        return x + self.self_attn(h, rope, kv_cache, meta) + self.mlp(h)  # HF's order of the sums


class CohereModel(LlamaModel):
    """Llama's stack with Cohere's layers, final LayerNorm and interleaved RoPE."""

    layer_class = CohereDecoderLayer
    rope_interleaved = True

    def make_norm(self, config: Any) -> nn.Module:
        return CohereLayerNorm(config.hidden_size, config.layer_norm_eps)


class CohereForCausalLM(LogitsScaling, LlamaForCausalLM):
    """Command-R decoder-only LM on a paged KV cache (see the module docstring); logits times
    `logit_scale` (None: unscaled)."""

    model_class = CohereModel
    tied_by_default = True

    def __init__(self, config: Any, **kwargs):
        check_cohere_config(config)
        super().__init__(config, **kwargs)
        scale = getattr(config, "logit_scale", 0.0625)
        self.logit_scale = 1.0 if scale is None else float(scale)
