"""BitNet b1.58's ternary linear layer (HF's `quantization_config.quant_method: "bitnet"`,
`linear_class: "bitlinear"`, offline: transformers' `integrations.bitnet.BitLinear`).

The checkpoint stores each projection `<p>` as `<p>.weight` uint8 `[N / 4, K]`: ternary values
{-1, 0, 1} stored as {0, 1, 2} in 2 bits, value row `i * N / 4 + r` in bits `2 i` of packed row
`r` (`unpack_ternary`); and `<p>.weight_scale` `[1]`. The product quantizes x per token to 8
bits, as HF does: `s = 127 / max|x|` (at least 1e-5), `xq = clamp(round(x * s), -128, 127)`,
`y = (xq W^T) / (weight_scale * s)` (then the bias). The ternary weight is held unpacked in the
model dtype (its values exact); `xq` is integers, so the product is exact in float32 while a row
sums to under 2^24.
"""

from __future__ import annotations

import torch
from torch import nn

VALUES_PER_BYTE = 4


def unpack_ternary(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [N / 4, K] -> [N, K]
    """HF's `unpack_weights`: the ternary values of a packed uint8 tensor, in `dtype`."""
    packed = packed.to(torch.uint8)
    parts = [((packed >> (2 * i)) & 3) for i in range(VALUES_PER_BYTE)]  # 4 x [N / 4, K]
    return torch.cat(parts, dim=0).to(dtype) - 1


def pack_ternary(values: torch.Tensor) -> torch.Tensor:  # [N, K] -> [N / 4, K] uint8
    """HF's `pack_weights` (N a multiple of 4): the inverse of `unpack_ternary`."""
    rows = values.shape[0] // VALUES_PER_BYTE
    codes = (values.round().to(torch.int16) + 1).to(torch.uint8)
    packed = torch.zeros((rows, *values.shape[1:]), dtype=torch.uint8)
    for i in range(VALUES_PER_BYTE):
        packed |= codes[i * rows:(i + 1) * rows] << (2 * i)
    return packed


class BitLinear(nn.Module):
    """`y = (clamp(round(x s)) W^T) / (weight_scale s) + b`, `s = 127 / max|x|` per token (see the
    module docstring); `weight` `[N, K]` the ternary values, loaded from the packed checkpoint
    tensor (`load_packed`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        if out_features % VALUES_PER_BYTE:
            raise ValueError(f"a BitNet projection's output size must be a multiple of 4, got {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        scale = 127 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)  # [T, 1]
        xq = (x * scale).round().clamp(-128, 127)  # [T, K]: integers
        y = torch.nn.functional.linear(xq, self.weight)  # [T, N]
        y = y / (self.weight_scale * scale)
        return y if self.bias is None else y + self.bias
