"""What the Mamba2 hybrid families share (Granite 4.0-H, Bamba, Nemotron-H, Falcon-H1): a stack
whose layers hold attention, a Mamba2 mixer (`layers.mamba2`), both or neither, each reading its
own cache entries.

A layer's entries are, in order, one `FullAttentionSpec` entry if it has attention, then the
`RecurrentStateSpec` entries of its mixer's state (`layers.recurrent_state`: how many depends
on the block size and the cache dtype, so `bind_cache` recomputes them and the KV spec). The
stack maps each layer onto its entries (`cache_entries_of`) and calls it as
`layer(x, *extras, caches, metas)` with those entries and their metadata.
Pipeline stages refuse these models (their cache entries are not their layers:
worker/pp_executor.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.kv_spec import FullAttentionSpec, RecurrentStateSpec
from pagedserve.distributed.tp import SINGLE
from pagedserve.layers.linear import VocabParallelEmbedding
from pagedserve.layers.mamba2 import Mamba2Mixer
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.layers.recurrent_state import KVPair
from pagedserve.models.base import DecoderStack, KVCacheSpec, PagedCausalLM, check_kv_caches


class HybridLayer(nn.Module):
    """A layer of a hybrid stack: a subclass sets `has_attention` and `mamba` (its
    `Mamba2Mixer`, or None) and implements `forward(x, *extras, caches, metas)`; `caches` are
    its entries (the attention's first)."""

    def __init__(self) -> None:
        super().__init__()
        self.has_attention = False
        self.mamba: Mamba2Mixer | None = None

    def entry_specs(self, num_kv_heads: int, head_dim: int) -> list:
        """One `core.kv_spec` spec per cache entry of this layer."""
        specs = [FullAttentionSpec(num_kv_heads, head_dim)] if self.has_attention else []
        if self.mamba is not None:
            specs += [RecurrentStateSpec(num_kv_heads, head_dim)] * self.mamba.num_entries
        return specs


class HybridStack(DecoderStack):
    """Embeddings, `HybridLayer`s (`self.layers`), final norm: a subclass builds them and
    implements `embed` and `final`; `bind` (from `__init__`'s end and `bind_cache`) maps the
    layers onto cache entries."""

    layers: nn.ModuleList

    def bind(self, block_size: int, cache_dtype: torch.dtype, num_kv_heads: int,
             head_dim: int) -> tuple:
        """Fit every mixer's state to the cache; returns the specs of all entries in order."""
        specs = []
        self.cache_entries_of = []
        for layer in self.layers:
            if layer.mamba is not None:
                layer.mamba.bind(block_size, cache_dtype)
            mine = layer.entry_specs(num_kv_heads, head_dim)
            self.cache_entries_of.append(list(range(len(specs), len(specs) + len(mine))))
            specs += mine
        return tuple(specs)

    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVPair],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        check_kv_caches(kv_caches, sum(len(e) for e in self.cache_entries_of))
        x, extras = self.embed(input_ids, positions)  # [T, H]
        metas = meta.per_layer or [meta] * len(kv_caches)  # per cache entry (its column's)
        for layer, extra, entries in zip(self.layers, extras, self.cache_entries_of):
            x = layer(x, *extra, [kv_caches[e] for e in entries], [metas[e] for e in entries])
        return self.final(x)


class PreNormHybridLayer(HybridLayer):
    """`x + mixer(norm(x)) * m`, then `x + mlp(norm(x)) * m`: the mixer is `self_attn` (a
    `models.llama.LlamaAttention`, called with the step's RoPE tables) or `mamba`; `m` is
    Granite's `residual_multiplier` (1 for Bamba)."""

    def __init__(self, hidden_size: int, eps: float, mlp: nn.Module, *,
                 attention: nn.Module | None = None, mamba: Mamba2Mixer | None = None,
                 residual_multiplier: float = 1.0):
        super().__init__()
        if (attention is None) == (mamba is None):
            raise ValueError("a hybrid layer has attention or a Mamba mixer, not both or neither")
        self.has_attention = attention is not None
        if attention is not None:
            self.self_attn = attention
        self.mamba = mamba
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.residual_multiplier = float(residual_multiplier)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], caches: list[KVPair],
                metas: list[AttentionMetadata]) -> torch.Tensor:  # [T, H] -> [T, H]
        h = self.input_layernorm(x)  # [T, H]
        if self.has_attention:
            h = self.self_attn(h, rope, caches[0], metas[0])
        else:
            h = self.mamba(h, caches, metas)
        m = self.residual_multiplier
        x = x + (h * m if m != 1.0 else h)
        h = self.mlp(self.post_attention_layernorm(x))  # [T, H]
        return x + (h * m if m != 1.0 else h)


class HybridModel(HybridStack):
    """Embeddings (times `embedding_multiplier`), `layers`, final RMSNorm (`eps`, by default
    `config.rms_norm_eps`); RoPE tables for the attention layers (`rope`:
    `rope_parameters(config)`), or with `rope=False` the identity rotation (NoPE, bit for bit)."""

    def __init__(self, config: Any, layers: list[HybridLayer], head_dim: int, *, rope: bool,
                 embedding_multiplier: float = 1.0, eps: float | None = None, tp=SINGLE):
        super().__init__()
        self.head_dim = head_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps if eps is None else eps)
        self.embedding_multiplier = float(embedding_multiplier)
        self.rotary_emb = (RotaryEmbedding(head_dim, rope_parameters(config), config.max_position_embeddings)
                           if rope else None)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        if self.rotary_emb is not None:
            rope = self.rotary_emb(positions, x.dtype)  # 2 x [T, R]
        else:  # NoPE: the identity rotation
            ones = torch.ones(len(positions), self.head_dim, dtype=x.dtype, device=x.device)  # [T, D]
            rope = (ones, torch.zeros_like(ones))
        return x, [(rope,)] * len(self.layers)

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.norm(x)


def page_of(config: Any, head_dim: int, tp) -> int:
    """The values of one cache entry a token on this rank: K and V of its KV heads."""
    return 2 * tp.local_kv_heads(config.num_key_value_heads) * head_dim


class HybridCausalLM(PagedCausalLM):
    """An LM over a `HybridStack` (`self.model`): after `_init_head`, `init_cache(num_kv_heads,
    head_dim)` (this rank's KV heads) binds the default cache and sets the KV spec; the
    engine's `bind_cache` redoes both."""

    def backbone(self) -> nn.Module:
        return self.model

    def init_cache(self, num_kv_heads: int, head_dim: int) -> None:
        self._kv_shape = (num_kv_heads, head_dim)
        self.bind_cache(16, torch.float32)

    def bind_cache(self, block_size: int, cache_dtype: torch.dtype) -> None:
        specs = self.model.bind(block_size, cache_dtype, *self._kv_shape)
        self.kv_cache_spec = KVCacheSpec(len(specs), *self._kv_shape, specs)


def mamba2_mixer(config: Any, page: int, tp, **overrides: Any) -> Mamba2Mixer:
    """A Mamba2 mixer from HF's `mamba_*` config attributes (Bamba's and Granite 4.0-H's names;
    `overrides` for families that name them otherwise)."""
    hidden = config.hidden_size
    heads = int(config.mamba_n_heads)
    head_dim = getattr(config, "mamba_d_head", "auto")
    if head_dim in (None, "auto"):
        head_dim = int(config.mamba_expand * hidden) // heads
    kwargs = dict(
        num_heads=heads, head_dim=int(head_dim), state_size=int(config.mamba_d_state),
        n_groups=int(config.mamba_n_groups), conv_kernel=int(config.mamba_d_conv),
        conv_bias=bool(config.mamba_conv_bias), proj_bias=bool(config.mamba_proj_bias),
        activation=config.hidden_act, norm_eps=float(config.rms_norm_eps),
        time_step_limit=tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf"))))
    kwargs.update(overrides)
    return Mamba2Mixer(hidden, page=page, tp=tp, **kwargs)
