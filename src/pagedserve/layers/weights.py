"""Copying HF-named checkpoint tensors into a model's parameters, strictly."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    rename: Callable[[str], str | None],
    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Copy every `(name, tensor)` of `weights` into the parameter `rename(name)` of `module`.

    `rename` maps a checkpoint name to a parameter name of `module`, or to None for tensors to skip
    (rotary buffers, a tied head). `transform(param_name, tensor)` may reshape a tensor first (e.g.
    transpose GPT-2's Conv1D weights). Tied parameters count once, under their first name.
    Raises ValueError naming the offenders for unexpected names, shape mismatches and parameters
    the checkpoint did not provide.
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        name = rename(hf_name)
        if name is None:
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(hf_name)
            continue
        if transform is not None:
            tensor = transform(name, tensor)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"weight {hf_name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    if unexpected:
        raise ValueError(f"unexpected weights in checkpoint: {_names(unexpected)}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"weights missing from checkpoint: {_names(missing)}")


def _names(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")
