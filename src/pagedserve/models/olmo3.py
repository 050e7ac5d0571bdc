"""OLMo 3 (`Olmo3ForCausalLM`): OLMo 2's layers (`models.olmo2`) with sliding-window layers.

Differences from OLMo 2, as in HF 5.x:
- `layer_types[i]` picks a sliding window (`sliding_window`; by default three sliding layers,
  then a full one) or full attention;
- each layer type has its own RoPE: `rope_parameters["sliding_attention"]` and
  `rope_parameters["full_attention"]` (a checkpoint's `rope_scaling`, e.g. OLMo 3's YaRN, applies
  to the full-attention layers only).
llama.cpp writes OLMo 3 as architecture "olmo2" with `attention.sliding_window` and a
`sliding_window_pattern` (`models.gguf_config`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.models.llama import head_dim_of
from pagedserve.models.olmo2 import Olmo2ForCausalLM, Olmo2Model


def olmo3_layer_types(config: Any) -> list[str]:
    """`config.layer_types`, or HF's default: every fourth layer full, the others sliding."""
    types = getattr(config, "layer_types", None)
    if types is None:
        types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                 for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    return list(types)


class Olmo3Model(Olmo2Model):
    """OLMo 2's stack with one rotary embedding per layer type."""

    def __init__(self, config: Any, *args, **kwargs):
        self.layer_types = olmo3_layer_types(config)  # (plain data: before nn.Module's init is fine)
        super().__init__(config, *args, **kwargs)

    def make_rotary_emb(self, config: Any) -> nn.Module:
        max_pos = config.max_position_embeddings
        return nn.ModuleDict({t: RotaryEmbedding(head_dim_of(config), rope_parameters(config, t), max_pos)
                              for t in sorted(set(self.layer_types))})

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        ropes = {t: rope(positions, x.dtype) for t, rope in self.rotary_emb.items()}  # 2 x [T, D] each
        return x, [(ropes[t],) for t in self.layer_types]


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    """OLMo 3 decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = Olmo3Model

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        window = getattr(config, "sliding_window", None)
        return [window if t == "sliding_attention" else None for t in olmo3_layer_types(config)]
