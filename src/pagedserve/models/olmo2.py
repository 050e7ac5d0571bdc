"""OLMo 2 (`Olmo2ForCausalLM`): the Llama decoder with post-norms and whole-projection q/k norms.

Differences from Llama, as in HF 5.x:
- no norm before attention or the MLP: each branch's output is normalised before it is added
  (`post_attention_layernorm`, `post_feedforward_layernorm`);
- q and k RMS-normalised over the whole projection (all heads at once: `q_norm` of
  num_heads * head_dim, `k_norm` of num_kv_heads * head_dim) before they are split into heads
  and rotated;
- OLMo's RMSNorm multiplies the weight in float32 before casting back (Llama's casts first).
Under tensor parallelism each rank holds its heads' slice of the q/k projections: the q/k norms
sum their slices' squares over the ranks (one all-reduce of `[T, 1]` each, as OLMoE's), and need
num_key_value_heads divisible by tensor_parallel_size (a replicated KV head would count twice).
The layer runs its modules (the fused decode layer has per-head q/k norms only).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import ShardSpec, set_shard
from pagedserve.layers.norms import sharded_mean_square
from pagedserve.layers.rotary import apply_rotary
from pagedserve.models.base import KVCache
from pagedserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class Olmo2RMSNorm(nn.Module):
    """`(weight * (x / rms(x)))` in float32, cast back to the input dtype (HF's `Olmo2RMSNorm`).
    With `full_size` and a parallel `tp`, x is this rank's slice of `full_size` features (the
    q/k projections' heads): the mean of squares spans every rank's slice, the weight is this
    rank's slice."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, full_size: int | None = None,
                 tp: TPContext = SINGLE):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.full_size, self.tp = full_size or hidden_size, tp
        if tp.is_parallel:
            start = tp.rank * hidden_size
            set_shard(self.weight, ShardSpec(0, ((start, start + hidden_size),), self.full_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        x32 = x.float()
        if self.tp.is_parallel:
            ms = sharded_mean_square(x32, self.tp, self.full_size)  # [..., 1] over every rank
        else:  # NOTE: one rank keeps torch's mean (its own summation order)
            ms = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(ms + self.eps)
        return (self.weight * x32).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class Olmo2Attention(LlamaAttention):
    """Llama's attention with q/k normalised over the whole projection before RoPE."""

    def __init__(self, config: Any, head_dim: int, sliding_window: int | None, tp: TPContext):
        super().__init__(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            scale=head_dim**-0.5, sliding_window=sliding_window, qkv_bias=config.attention_bias,
            o_bias=config.attention_bias, tp=tp,
        )
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if tp.is_parallel and kv_heads % tp.world_size:
            raise ValueError(f"OLMo 2's k norm needs num_key_value_heads ({kv_heads}) divisible by "
                             f"tensor_parallel_size ({tp.world_size})")
        self.q_norm = Olmo2RMSNorm(self.num_heads * head_dim, config.rms_norm_eps,
                                   full_size=heads * head_dim, tp=tp)
        self.k_norm = Olmo2RMSNorm(self.num_kv_heads * head_dim, config.rms_norm_eps,
                                   full_size=kv_heads * head_dim, tp=tp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x)).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_norm(self.k_proj(x)).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = apply_rotary(q, k, *rope)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))  # [T, H]


class Olmo2DecoderLayer(LlamaDecoderLayer):
    """Post-norm block: x + post_attn_norm(attn(x)), then x + post_ff_norm(mlp(x))."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        super().__init__(config, sliding_window, qkv_bias=qkv_bias, qk_norm=False, tp=tp)
        head_dim = self.self_attn.head_dim
        self.self_attn = Olmo2Attention(config, head_dim, sliding_window, tp)
        del self.input_layernorm
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.unfused(x, rope, kv_cache, meta)

    def unfused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        x = x + self.post_attention_layernorm(self.self_attn(x, rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(LlamaModel):
    layer_class = Olmo2DecoderLayer

    def __init__(self, config: Any, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.norm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 decoder-only LM on a paged KV cache."""

    model_class = Olmo2Model
