"""Activation functions by their HF config names (`hidden_act`, `activation_function`)."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

_GELU_TANH = partial(F.gelu, approximate="tanh")

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
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
