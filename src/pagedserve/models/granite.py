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

import math
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


def exact_fp32_scale(scale: float) -> bool:
    """Whether multiplying or dividing fp32 values by `scale` keeps their order and ties: 1, or a
    positive power of two (exact in fp32, short of subnormal results)."""
    return scale == 1.0 or (scale > 0 and math.frexp(scale)[0] == 0.5)


class LogitsScaling:
    """Logits scaled by a constant the LM sets: divided by `logits_scaling` (Granite) and / or
    multiplied by `logit_scale` (Cohere); mixed in before the LM class (Granite, Granite MoE,
    Cohere, Cohere 2)."""

    logits_scaling: float = 1.0
    logit_scale: float = 1.0

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] fp32
        logits = super().compute_logits(hidden)  # [S, V]
        if self.logits_scaling != 1.0:
            logits = logits.div_(self.logits_scaling)
        if self.logit_scale != 1.0:
            logits = logits.mul_(self.logit_scale)
        return logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [S, H] -> [S] int64
        """As `PagedCausalLM.greedy_tokens` under a scaling that keeps every fp32 logit's order
        and ties (`exact_fp32_scale`: none, or a power of two such as Command-R's 1/16); None
        under another: rounding in fp32 can make distinct logits equal, which moves ties (see
        `final_softcap`)."""
        if exact_fp32_scale(self.logits_scaling) and exact_fp32_scale(self.logit_scale):
            return super().greedy_tokens(hidden)
        return None


class GraniteForCausalLM(LogitsScaling, LlamaForCausalLM):
    """Granite decoder-only LM on a paged KV cache; logits divided by `logits_scaling`."""

    model_class = GraniteModel

    def __init__(self, config: Any, **kwargs):
        super().__init__(config, **kwargs)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))
