"""Activation functions by their HF config names (`hidden_act`, `activation_function`)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_fp32 import invariant_activation


def silu(x: torch.Tensor) -> torch.Tensor:
    """`F.silu`; float32 on CPU through the batch-invariant kernel (`kernels.cpu_fp32`)."""
    if x.dtype is torch.float32:
        y = invariant_activation(x, "silu")
        if y is not None:
            return y
    return F.silu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """`F.gelu(x, approximate="tanh")`; float32 on CPU through the batch-invariant kernel."""
    if x.dtype is torch.float32:
        y = invariant_activation(x, "gelu_tanh")
        if y is not None:
            return y
    return F.gelu(x, approximate="tanh")


_GELU_TANH = gelu_tanh

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu,
    "swish": silu,
    "relu": F.relu,
    "gelu": F.gelu,
    # All tanh approximations of GELU: same function, differing only in float rounding.
    "gelu_new": _GELU_TANH,
    "gelu_fast": _GELU_TANH,
    "gelu_pytorch_tanh": _GELU_TANH,
    "gelu_python_tanh": _GELU_TANH,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function called `name` in HF configs; ValueError if we do not know it."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(ACTIVATIONS)}") from None
