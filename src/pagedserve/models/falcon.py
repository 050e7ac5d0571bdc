"""Falcon (`FalconForCausalLM`: Falcon 7B / 40B / 180B), as HF 5.x implements it, with rotary
positions.

- attention: one fused `query_key_value` projection, laid out per the config:
  `new_decoder_architecture` (40B / 180B): per KV group `[group's queries, key, value]` of
  `num_kv_heads` groups; `multi_query` (7B): every query head, then one key head, then one value
  head; neither: per head `(q, k, v)`; rotate-half RoPE on whole heads; scale head_dim ** -0.5;
- block: `parallel_attn` (7B) `x + attn(ln(x)) + mlp(ln(x))` on one `input_layernorm`;
  `new_decoder_architecture` the same with `ln_attn` / `ln_mlp` (`num_ln_in_parallel_attn` 2,
  its default) or one `input_layernorm` (1); otherwise sequential with
  `post_attention_layernorm`; LayerNorms with biases; `dense_h_to_4h` / `dense_4h_to_h` MLP of
  `ffn_hidden_size` and `activation`; linear biases per `bias`;
- the LM head tied to `word_embeddings` by default.
ALiBi checkpoints (`alibi`: Falcon-RW) are refused (ValueError naming it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import get_activation
from pagedserve.layers.attention import PagedAttention
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from pagedserve.layers.norms import LayerNorm
from pagedserve.layers.rotary import RotaryEmbedding, norm_and_rotate, rope_parameters
from pagedserve.models.base import DecoderStack, KVCache, PagedCausalLM
from pagedserve.platforms import OpsUser


def falcon_kv_heads(config: Any) -> int:
    """The KV heads of a Falcon config (as HF's attention derives them)."""
    if config.new_decoder_architecture:
        return int(config.num_kv_heads)
    return 1 if config.multi_query else int(config.num_attention_heads)


class FalconAttention(OpsUser, nn.Module):
    """Self-attention with Falcon's fused `query_key_value` (see the module docstring)."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        if tp.is_parallel:
            raise ValueError("Falcon under tensor parallelism is not supported")
        h, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = d = h // heads
        if d * heads != h:
            raise ValueError(f"hidden_size ({h}) must be divisible by num_attention_heads ({heads})")
        self.num_heads, self.num_kv_heads = heads, falcon_kv_heads(config)
        self.layout = "grouped" if config.new_decoder_architecture else "mqa" if config.multi_query else "per_head"
        bias = bool(config.bias)
        self.query_key_value = ColumnParallelLinear(h, (heads + 2 * self.num_kv_heads) * d, bias, tp=tp)
        self.dense = RowParallelLinear(h, h, bias, tp=tp)
        self.attn = PagedAttention(heads, self.num_kv_heads, d, d**-0.5)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        t, d = x.shape[0], self.head_dim
        qkv = self.query_key_value(x)  # [T, (Hq + 2 Hkv) D]
        if self.layout == "grouped":  # [T, Hkv, group + 2, D]
            g = qkv.view(t, self.num_kv_heads, -1, d)
            q, k, v = g[:, :, :-2].reshape(t, self.num_heads, d), g[:, :, -2], g[:, :, -1]
        elif self.layout == "mqa":
            q, k, v = qkv.view(t, -1, d).split([self.num_heads, 1, 1], dim=1)
        else:  # [T, H, 3, D]
            q, k, v = qkv.view(t, self.num_heads, 3, d).unbind(2)
        q, k = norm_and_rotate(q.contiguous(), k.contiguous(), *rope, None, None, self.ops)
        return self.dense(self.attn(q, k, v.contiguous(), kv_cache, meta))  # [T, H]


class FalconMLP(nn.Module):
    """dense_4h_to_h(act(dense_h_to_4h(x)))."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        inner = getattr(config, "ffn_hidden_size", None) or 4 * config.hidden_size
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, inner, bool(config.bias), tp=tp)
        self.dense_4h_to_h = RowParallelLinear(inner, config.hidden_size, bool(config.bias), tp=tp)
        self.act = get_activation(getattr(config, "activation", "gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    """A Falcon block: parallel (one or two LayerNorms) or sequential (see the module docstring)."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_epsilon
        self.self_attention = FalconAttention(config, tp=tp)
        self.mlp = FalconMLP(config, tp=tp)
        self.new_arch = bool(config.new_decoder_architecture)
        self.parallel = self.new_arch or bool(config.parallel_attn)
        n_ln = getattr(config, "num_ln_in_parallel_attn", None) or 2
        self.two_norms = self.new_arch and n_ln == 2
        if self.new_arch and not config.parallel_attn and n_ln != 2:
            raise ValueError("Falcon new_decoder_architecture with parallel_attn=False and one LayerNorm "
                             "is not supported")
        if self.two_norms:
            self.ln_attn, self.ln_mlp = LayerNorm(h, eps=eps), LayerNorm(h, eps=eps)
        else:
            self.input_layernorm = LayerNorm(h, eps=eps)
            if not self.parallel:
                self.post_attention_layernorm = LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        if self.two_norms:
            a, m = self.ln_attn(x), self.ln_mlp(x)
        else:
            a = m = self.input_layernorm(x)
        attn = self.self_attention(a, rope, kv_cache, meta)  # [T, H]
        if not self.parallel:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        return x + (self.mlp(m) + attn)  # (HF's order: mlp + attn, then the residual)


class FalconModel(DecoderStack):
    """Word embeddings, Falcon blocks, final LayerNorm (HF's `transformer`)."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.h = nn.ModuleList(FalconDecoderLayer(config, tp=tp) for _ in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.rotary_emb = RotaryEmbedding(config.hidden_size // config.num_attention_heads, rope_parameters(config),
                                          config.max_position_embeddings)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.word_embeddings(input_ids)  # [T, H]
        return x, [(self.rotary_emb(positions, x.dtype),)] * len(self.h)

    def decoder_layers(self) -> nn.ModuleList:
        return self.h

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.ln_f(x)


class FalconForCausalLM(PagedCausalLM):
    """Falcon LM on a paged KV cache (see the module docstring)."""

    checkpoint_prefix = "transformer."

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        if getattr(config, "alibi", False):
            raise ValueError("Falcon with alibi=True (ALiBi position bias, Falcon-RW) is not supported")
        self.transformer = FalconModel(config, tp=tp)
        self._init_head(config, self.transformer.word_embeddings, head_in=config.hidden_size,
                        num_kv_heads=falcon_kv_heads(config),
                        head_dim=config.hidden_size // config.num_attention_heads, tp=tp)

    def backbone(self) -> nn.Module:
        return self.transformer
