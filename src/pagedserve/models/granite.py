"""Granite 3.x (`GraniteForCausalLM`): the Llama decoder with four multipliers.

Differences from Llama, as in HF 5.x:
- embeddings multiplied by `embedding_multiplier`;
- each residual branch (attention, MLP) multiplied by `residual_multiplier` before it is added;
- `attention_multiplier` is the attention's softmax scale (not head_dim ** -0.5);
- logits divided by `logits_scaling`.
NOTE: the fused decode layer knows no residual multiplier: Granite layers with one != 1 run their
modules (`platforms.cpu_decode`).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.models.base import KVCache
from pagedserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with `residual_multiplier` on both branches and
    `attention_multiplier` as the attention scale."""

    def __init__(self, config: Any, sliding_window: int | None, **kwargs):
        super().__init__(config, sliding_window, **kwargs)
        self.self_attn.attn.scale = float(config.attention_multiplier)
        self.residual_multiplier = float(config.residual_multiplier)

    def unfused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta) * self.residual_multiplier
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class EmbeddingMultiplier:
    """Granite's embeddings times `config.embedding_multiplier`; mixed in before the stack class
    (Granite's LlamaModel, Granite MoE's MoEModel), whose first argument is the config."""

    def __init__(self, config: Any, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.embedding_multiplier = float(config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x, extras = super().embed(input_ids, positions)
        return x * self.embedding_multiplier, extras  # [T, H]


class GraniteModel(EmbeddingMultiplier, LlamaModel):
    """Llama's stack with Granite's layers and the embedding multiplier."""

    layer_class = GraniteDecoderLayer


class LogitsScaling:
    """Granite's logits divided by `logits_scaling` (the LM sets `self.logits_scaling`); mixed in
    before the LM class (Granite, Granite MoE)."""

    logits_scaling: float = 1.0

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] fp32
        logits = super().compute_logits(hidden)  # [S, V]
        return logits.div_(self.logits_scaling) if self.logits_scaling != 1.0 else logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [S, H] -> [S] int64
        """As `PagedCausalLM.greedy_tokens`, except under a `logits_scaling` != 1: dividing in
        fp32 can round distinct logits to equal ones, which moves ties (see `final_softcap`)."""
        return super().greedy_tokens(hidden) if self.logits_scaling == 1.0 else None


class GraniteForCausalLM(LogitsScaling, LlamaForCausalLM):
    """Granite decoder-only LM on a paged KV cache; logits divided by `logits_scaling`."""

    model_class = GraniteModel

    def __init__(self, config: Any, **kwargs):
        super().__init__(config, **kwargs)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))
