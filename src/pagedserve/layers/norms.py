"""Normalization layers matching HF numerics (statistics in float32, cast back)."""

from __future__ import annotations

import torch
from torch import nn

LayerNorm = nn.LayerNorm  # GPT-2 / OPT use torch's LayerNorm as is.


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: `weight * (x / rms(x))`, normalized in float32 and cast back to the input
    dtype before the (model-dtype) weight multiplies it, as `LlamaRMSNorm` does."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma RMSNorm: the stored weight is an offset, `x / rms(x) * (1 + weight)`, all in float32,
    then cast to the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
