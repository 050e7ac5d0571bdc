"""OPT (`OPTForCausalLM`), as HF 5.x implements it.

- learned positions with an offset of 2: position p reads row p + 2 of `embed_positions`;
- `do_layer_norm_before` picks pre-norm (125m, 1.3b+) or post-norm (350m) blocks;
- when `word_embed_proj_dim != hidden_size` (350m), `project_in` maps token embeddings up and
  `project_out` maps the final hidden states back down; the tied LM head works in that smaller space;
- the final layer norm exists only for pre-norm models without `_remove_final_layer_norm`;
- queries are multiplied by head_dim ** -0.5 before attention (HF's order); ReLU MLP.
"""

from __future__ import annotations

from typing import Any

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

POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    """Multi-head self-attention with biased projections on the paged cache (this rank's
    `num_heads / N` heads: column-parallel q/k/v, row-parallel out)."""

    def __init__(self, hidden_size: int, num_heads: int, bias: bool, *, tp: TPContext = SINGLE):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_attention_heads ({num_heads})")
        self.num_heads, self.head_dim = tp.split(num_heads, "num_attention_heads"), hidden_size // num_heads
        self.scaling = self.head_dim**-0.5
        self.k_proj = ColumnParallelLinear(hidden_size, hidden_size, bias, tp=tp)
        self.v_proj = ColumnParallelLinear(hidden_size, hidden_size, bias, tp=tp)
        self.q_proj = ColumnParallelLinear(hidden_size, hidden_size, bias, tp=tp)
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias, tp=tp)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, scale=1.0)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:  # [T, H]
        t = x.shape[0]
        q = (self.q_proj(x) * self.scaling).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        v = self.v_proj(x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        return self.out_proj(self.attn(q, k, v, kv_cache, meta))  # [T, H]


class OPTDecoderLayer(nn.Module):
    """Attention + ReLU MLP, each with a residual, LayerNorm before (pre-norm) or after (post-norm)."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        h, affine = config.hidden_size, config.layer_norm_elementwise_affine
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttention(h, config.num_attention_heads, config.enable_bias, tp=tp)
        self.self_attn_layer_norm = LayerNorm(h, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(h, config.ffn_dim, config.enable_bias, tp=tp)
        self.fc2 = RowParallelLinear(config.ffn_dim, h, config.enable_bias, tp=tp)
        self.final_layer_norm = LayerNorm(h, elementwise_affine=affine)
        self.act_fn = get_activation(config.activation_function)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:  # [T, H]
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x), kv_cache, meta)
            return x + self.fc2(self.act_fn(self.fc1(self.final_layer_norm(x))))
        x = self.self_attn_layer_norm(x + self.self_attn(x, kv_cache, meta))
        return self.final_layer_norm(x + self.fc2(self.act_fn(self.fc1(x))))


class OPTDecoder(DecoderStack):
    """Embeddings (+ project_in), layers, final norm (+ project_out): HF's `model.decoder`.
    Positions, projections and norms are replicated on every rank."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        h, e = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, e, tp=tp)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, h)
        self.project_in = nn.Linear(e, h, bias=False) if e != h else None
        self.project_out = nn.Linear(h, e, bias=False) if e != h else None
        has_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        self.final_layer_norm = (
            LayerNorm(h, elementwise_affine=config.layer_norm_elementwise_affine) if has_final_norm else None
        )
        self.layers = nn.ModuleList(OPTDecoderLayer(config, tp=tp) for _ in range(config.num_hidden_layers))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, E]
        if self.project_in is not None:
            x = self.project_in(x)  # [T, H]
        return x + self.embed_positions(positions + POSITION_OFFSET), [()] * len(self.layers)  # [T, H]

    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E]
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)  # [T, E]
        return x


class OPTModel(nn.Module):
    """HF's `model` wrapper: holds the decoder."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.decoder = OPTDecoder(config, tp=tp)


class OPTForCausalLM(PagedCausalLM):
    """OPT decoder-only LM on a paged KV cache (see `pagedserve.models.base.CausalLM`). `forward`
    returns `[T, word_embed_proj_dim]` (after `project_out`), what the LM head reads; `tp` makes
    it this rank's shard. Checkpoints name the stack `model.decoder.*` (`decoder.*` in the
    original ones)."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.model = OPTModel(config, tp=tp)
        self._init_head(config, self.model.decoder.embed_tokens, head_in=config.word_embed_proj_dim,
                        num_kv_heads=config.num_attention_heads,
                        head_dim=config.hidden_size // config.num_attention_heads, tp=tp)

    def backbone(self) -> nn.Module:
        return self.model.decoder
