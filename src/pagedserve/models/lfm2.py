"""LFM2 (`Lfm2ForCausalLM`, Liquid AI's on-device models): gated short convolutions and
attention layers.

`config.layer_types[i]` is "conv" (a gated short convolution, `layers.short_conv.ShortConv`,
whose state is kept in the paged cache as a sliding window of `conv_L_cache` rows) or
"full_attention" (Qwen3's layer: RMSNorm on each head's q and k before RoPE). Every layer is
pre-norm with a SwiGLU MLP (`w1` gate, `w3` up, `w2` down; its width `block_auto_adjust_ff_dim`-
adjusted as HF does); the final norm is HF's `embedding_norm`. HF's names map onto ours at load
(`operator_norm` -> `input_layernorm`, `out_proj` -> `o_proj`, `q_layernorm` -> `q_norm`, ...), so
the attention layers are `models.llama` layers and take the fused decode path.

The cache has one entry per attention layer and `cache_entries(hidden, page)` per conv layer
(`layers.short_conv`): the model maps its layers onto them (`cache_entries_of`).
llama.cpp writes LFM2 as architecture "lfm2" (`models.gguf_config`).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.kv_spec import FullAttentionSpec, SlidingWindowSpec
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import VocabParallelEmbedding
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.layers.short_conv import ShortConv, cache_entries
from pagedserve.models.base import CacheEntryStack, KVCache, KVCacheSpec, PagedCausalLM
from pagedserve.models.llama import (
    FusableDecoderLayer, LlamaAttention, LlamaDecoderLayer, LlamaMLP, head_dim_of)

CONV, ATTENTION = "conv", "full_attention"

# HF's parameter names -> ours (a checkpoint name's segments)
_RENAMES = (
    (".operator_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    ("model.embedding_norm.", "model.norm."),
)


def lfm2_layer_types(config: Any) -> list[str]:
    """`config.layer_types` (HF derives them from `full_attn_idxs`); ValueError on a type we do not
    know or a count that is not the layers'."""
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    if unknown := sorted(set(types) - {CONV, ATTENTION}):
        raise ValueError(f"config.layer_types: unsupported layer type(s) {unknown}; LFM2 has {CONV!r} "
                         f"and {ATTENTION!r}")
    return types


def lfm2_mlp_width(config: Any, width: int | None = None) -> int:
    """The SwiGLU's width as HF's `Lfm2MLP` computes it from `intermediate_size`."""
    width = config.intermediate_size if width is None else width
    if getattr(config, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        if (mult := getattr(config, "block_ffn_dim_multiplier", None)) is not None:
            width = int(mult * width)
            step = config.block_multiple_of
            width = step * ((width + step - 1) // step)
    return width


class Lfm2ConvLayer(nn.Module):
    """A conv layer: `x + conv(norm(x))`, then `x + mlp(norm(x))` (`mlp`: any `[T, H] -> [T, H]`
    module; LFM2-MoE's sparse blocks too)."""

    def __init__(self, config: Any, mlp: nn.Module, page: int, tp: TPContext = SINGLE):
        super().__init__()
        eps = config.norm_eps
        self.conv = ShortConv(config.hidden_size, config.conv_L_cache, bias=config.conv_bias, page=page,
                              tp=tp)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, caches: list[KVCache], metas: list[AttentionMetadata]) -> torch.Tensor:
        x = x + self.conv(self.input_layernorm(x), caches, metas)  # [T, H]
        return x + self.mlp(self.post_attention_layernorm(x))


class Lfm2AttentionLayer(LlamaDecoderLayer):
    """An attention layer: Qwen3's (q/k RMSNorm before RoPE, full attention) with the given
    feed-forward block; the fused decode layer takes it as a Llama layer."""

    def __init__(self, config: Any, mlp: nn.Module, tp: TPContext = SINGLE):
        FusableDecoderLayer.__init__(self)
        head_dim, eps = head_dim_of(config), config.norm_eps
        self.self_attn = LlamaAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            scale=head_dim**-0.5, qk_norm=lambda d: RMSNorm(d, eps), tp=tp)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        if isinstance(self.mlp, LlamaMLP):  # the whole layer may be one fused call
            return super().forward(x, rope, kv_cache, meta)
        # another feed-forward (LFM2-MoE's experts): the attention half alone may be fused
        fused = self.ops.decoder_attention(self, x, rope, kv_cache, meta)
        if fused is not None:
            r, h = fused  # [T, H]: x + attention, its post-attention norm
            return r + self.mlp(h)
        return self.unfused(x, rope, kv_cache, meta)


class Lfm2Model(CacheEntryStack):
    """Embeddings, conv and attention layers, final norm; each layer reads its own cache entries
    (`cache_entries_of`). `make_mlp(config, layer_index)` builds a layer's feed-forward block."""

    one_entry_kinds = (ATTENTION,)

    def __init__(self, config: Any, make_mlp, tp: TPContext = SINGLE):
        super().__init__()
        self.layer_types = lfm2_layer_types(config)
        head_dim = head_dim_of(config)
        # K and V values of a token on this rank (its KV heads: `TPContext.local_kv_heads`)
        self.page = 2 * tp.local_kv_heads(config.num_key_value_heads) * head_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        layers = []
        for i, kind in enumerate(self.layer_types):
            if kind == CONV:
                layers.append(Lfm2ConvLayer(config, make_mlp(config, i, tp), self.page, tp))
            else:
                layers.append(Lfm2AttentionLayer(config, make_mlp(config, i, tp), tp))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim, rope_parameters(config), config.max_position_embeddings)
        counts = [layer.conv.num_entries if kind == CONV else 1
                  for layer, kind in zip(self.layers, self.layer_types)]
        starts = list(itertools.accumulate([0] + counts))
        # layer i's cache entries (one per attention layer, `num_entries` per conv layer)
        self.cache_entries_of = [list(range(a, a + n)) for a, n in zip(starts, counts)]

    def cache_specs(self, num_kv_heads: int, head_dim: int, window: int) -> tuple:
        """One `core.kv_spec` spec per cache entry: full attention, or a window of the conv's
        `window` rows."""
        specs = []
        for kind, entries in zip(self.layer_types, self.cache_entries_of):
            spec = (FullAttentionSpec(num_kv_heads, head_dim) if kind == ATTENTION
                    else SlidingWindowSpec(num_kv_heads, head_dim, window=window))
            specs += [spec] * len(entries)
        return tuple(specs)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary_emb(positions, x.dtype)  # 2 x [T, D]
        return x, [(rope,) if kind == ATTENTION else () for kind in self.layer_types]

    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.norm(x)


class Lfm2ForCausalLM(PagedCausalLM):
    """LFM2 decoder-only LM on a paged cache (see the module docstring); `tp` makes it this rank's
    shard (conv channels, heads and MLP sliced). Pipeline stages refuse it (its cache entries
    are not its layers: worker/pp_executor.py)."""

    tied_by_default = True

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.model = Lfm2Model(config, self.make_mlp, tp=tp)
        head_dim = head_dim_of(config)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=head_dim, tp=tp)
        kv_heads = tp.local_kv_heads(config.num_key_value_heads)
        specs = self.model.cache_specs(kv_heads, head_dim, config.conv_L_cache)
        self.kv_cache_spec = KVCacheSpec(len(specs), kv_heads, head_dim, specs)

    @staticmethod
    def make_mlp(config: Any, layer_index: int, tp: TPContext) -> nn.Module:
        """The feed-forward block of layer `layer_index`: LFM2's SwiGLU."""
        return LlamaMLP(config.hidden_size, lfm2_mlp_width(config), "silu", tp=tp)

    def backbone(self) -> nn.Module:
        return self.model

    def load_weights(self, weights) -> None:
        """HF checkpoint tensors (or a GGUF's, named as HF's); the conv weight may come as
        `[C, L]` (llama.cpp squeezes HF's `[C, 1, L]`)."""
        def shaped(items):
            for name, t in items:
                if name.endswith("conv.conv.weight") and isinstance(t, torch.Tensor) and t.dim() == 2:
                    t = t.unsqueeze(1)  # [C, 1, L]
                yield name, t
        super().load_weights(shaped(weights))

    def _rename(self, name: str) -> str | None:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return super()._rename(name)
