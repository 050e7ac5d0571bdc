"""The residual arrangements of decoder layers the fused decode kernel does not run (LayerNorms:
Phi-1.5 / Phi-2, StableLM, StarCoder 2, GPT-NeoX, OLMo, Nemotron; non-gated MLPs: Arcee, Apertus),
shared by their families: the layer's attention and MLP are built by the family, this block adds
them up.

- sequential: `x + attn(n1(x))`, then `h + mlp(n2(h))` (`post_attention_layernorm` given);
- parallel, one norm: `x + attn(n1(x)) + mlp(n1(x))` (Phi-2, StableLM's `use_parallel_residual`);
- parallel, two norms: `x + attn(n1(x)) + mlp(n2(x))` (GPT-NeoX's `use_parallel_residual`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ResidualBlock(nn.Module):
    """One decoder layer: `self_attn` (called as `self_attn(h, rope, kv_cache, meta)`), `mlp`,
    `input_layernorm` and `post_attention_layernorm` (None: the parallel block's one norm); with
    `parallel` both branches read the layer's input (see the module docstring). A family's layer
    subclasses it and calls `__init__` with the modules it built (their names are the
    checkpoint's, after the family's renames)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module | None, *, parallel: bool):
        super().__init__()
        if post_attention_layernorm is None and not parallel:
            raise ValueError("a sequential residual block needs its post-attention norm")
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm
        self.parallel = parallel

    def forward(self, x: torch.Tensor, rope: Any, kv_cache: Any, meta: Any) -> torch.Tensor:  # [T, H]
        h = self.input_layernorm(x)  # [T, H]
        a = self.self_attn(h, rope, kv_cache, meta)  # [T, H]
        if not self.parallel:
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x))
        m = self.mlp(h if self.post_attention_layernorm is None else self.post_attention_layernorm(x))
        return x + a + m  # [T, H]
