"""Activation functions by their HF config names (`hidden_act`, `activation_function`).

`get_activation(name)` gives an `Activation` layer: torch's function, except float32 / bf16 silu
and tanh-GELU, which go to the platform's ops first (`LayerOps.activation`: on the CPU platform
the batch-invariant kernel of `kernels.cpu_fp32`, one vector formula for every element).
NOTE: the fused CPU decode layer (kernels/cpu_decoder_layer.py) calls the same kernel whenever
this does, so the two stay bit for bit equal.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.platforms import OpsUser


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


# name -> (torch function, the ops' kernel name or None)
_TABLE: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str | None]] = {
    "silu": (F.silu, "silu"),
    "swish": (F.silu, "silu"),
    "relu": (F.relu, None),
    "relu2": (_relu_squared, None),  # Nemotron-H's MLPs (HF's ReLUSquaredActivation)
    "gelu": (F.gelu, None),
    # All tanh approximations of GELU: same function, differing only in float rounding.
    "gelu_new": (_gelu_tanh, "gelu_tanh"),
    "gelu_fast": (_gelu_tanh, "gelu_tanh"),
    "gelu_pytorch_tanh": (_gelu_tanh, "gelu_tanh"),
    "gelu_python_tanh": (_gelu_tanh, "gelu_tanh"),
}

ACTIVATIONS = tuple(_TABLE)
"""The activation names we know."""


class Activation(OpsUser, nn.Module):
    """One activation function (see the module docstring); no parameters."""

    def __init__(self, name: str) -> None:
        super().__init__()
        try:
            self.fn, self.kernel = _TABLE[name]
        except KeyError:
            raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_TABLE)}") from None
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dtype in (torch.float32, torch.bfloat16):
            y = self.ops.activation(x, self.kernel)
            if y is not None:
                return y
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name


def get_activation(name: str) -> Activation:
    """The activation called `name` in HF configs; ValueError if we do not know it."""
    return Activation(name)


class XIELU(nn.Module):
    """xIELU (Apertus's MLP activation, HF's `XIELUActivation`, its Python form) with its
    learned scalars as loaded from the checkpoint: `alpha_p`, `alpha_n` (softplus-parametrized,
    `[1]` each) and `beta`, `eps` (scalars);
    `x > 0: a_p x^2 + beta x`, else `(expm1(min(x, eps)) - x) a_n + beta x`, with
    `a_p = softplus(alpha_p)`, `a_n = beta + softplus(alpha_n)` in the parameters' dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.beta = nn.Parameter(torch.tensor(0.5), requires_grad=False)
        self.eps = nn.Parameter(torch.tensor(-1e-6), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., I] -> [..., I]
        alpha_p = F.softplus(self.alpha_p)  # [1]
        alpha_n = self.beta + F.softplus(self.alpha_n)  # [1]
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)
