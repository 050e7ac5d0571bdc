"""GPT-2 (`GPT2LMHeadModel`), as HF 5.x implements it.

HF stores GPT-2's projections as `Conv1D` with weights `[in, out]`; we use `nn.Linear` (`[out, in]`)
and transpose those weights on load. `c_attn` is the fused q|k|v projection. Learned absolute
positions, pre-norm blocks, gelu_new MLP, final `ln_f`, LM head tied to `wte`. Attention scale is
head_dim ** -0.5 (when `scale_attn_weights`), divided by layer_idx + 1 when
`scale_attn_by_inverse_layer_idx`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import get_activation
from pagedserve.layers.attention import PagedAttention
from pagedserve.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedserve.layers.norms import LayerNorm
from pagedserve.models.base import DecoderStack, KVCache, PagedCausalLM

_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


class GPT2Attention(nn.Module):
    """Multi-head self-attention with a fused q|k|v projection (this rank's `num_heads / N` heads:
    its slice of each of q, k and v)."""

    def __init__(self, config: Any, layer_idx: int, *, tp: TPContext = SINGLE):
        super().__init__()
        h, num_heads = config.hidden_size, config.num_attention_heads
        if h % num_heads:
            raise ValueError(f"hidden_size ({h}) must be divisible by num_attention_heads ({num_heads})")
        self.head_dim = h // num_heads
        self.num_heads = tp.split(num_heads, "num_attention_heads")
        scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        self.c_attn = ColumnParallelLinear(h, [h, h, h], tp=tp)
        self.c_proj = RowParallelLinear(h, h, tp=tp)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, scale)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:  # [T, H]
        t = x.shape[0]
        q, k, v = self.c_attn(x).view(t, 3, self.num_heads, self.head_dim).unbind(1)  # 3 x [T, Hq, D]
        return self.c_proj(self.attn(q, k, v, kv_cache, meta))  # [T, H]


class GPT2MLP(nn.Module):
    """c_proj(act(c_fc(x)))."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        inner = config.n_inner if config.n_inner is not None else 4 * config.hidden_size
        self.c_fc = ColumnParallelLinear(config.hidden_size, inner, tp=tp)
        self.c_proj = RowParallelLinear(inner, config.hidden_size, tp=tp)
        self.act = get_activation(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Pre-norm block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: Any, layer_idx: int, *, tp: TPContext = SINGLE):
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention is not a causal LM; not supported")
        self.ln_1 = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPT2Attention(config, layer_idx, tp=tp)
        self.ln_2 = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config, tp=tp)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:  # [T, H]
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(DecoderStack):
    """Token + position embeddings, blocks, final LayerNorm (HF's `transformer`); positions and
    norms are replicated on every rank."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i, tp=tp) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        return self.wte(input_ids) + self.wpe(positions), [()] * len(self.h)  # [T, H]

    def decoder_layers(self) -> nn.ModuleList:
        return self.h

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.ln_f(x)


class GPT2LMHeadModel(PagedCausalLM):
    """GPT-2 LM on a paged KV cache (see `pagedserve.models.base.CausalLM`); `tp` makes it this
    rank's shard. Checkpoints name the stack `transformer.*` (or bare `h.*` / `wte.*`) and store
    Conv1D weights transposed."""

    checkpoint_prefix = "transformer."

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.transformer = GPT2Model(config, tp=tp)
        self._init_head(config, self.transformer.wte, head_in=config.hidden_size,
                        num_kv_heads=config.num_attention_heads,
                        head_dim=config.hidden_size // config.num_attention_heads, tp=tp)

    def backbone(self) -> nn.Module:
        return self.transformer

    def _rename(self, name: str) -> str | None:
        # attn.bias / attn.masked_bias: causal-mask buffers stored by old checkpoints.
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None
        return super()._rename(name)

    def _transposed(self) -> Callable[[str], bool]:
        return lambda name: name.endswith(_CONV1D)
