"""Copying HF-named checkpoint tensors into a model's parameters, strictly, shard by shard."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

# A checkpoint tensor: a torch.Tensor, or a lazy safetensors slice (`safe_open(...).get_slice`)
# that reads only the rows it is indexed with.
TensorSource = Any


def source_shape(source: TensorSource) -> tuple[int, ...]:
    """Shape of a tensor or of a lazy safetensors slice."""
    if isinstance(source, torch.Tensor):
        return tuple(source.shape)
    return tuple(source.get_shape())


def read_ranges(source: TensorSource, dim: int, ranges) -> torch.Tensor:
    """The concatenation along `dim` of `source[..., start:stop, ...]` for each range; a lazy
    slice reads only those elements."""
    parts = []
    for start, stop in ranges:
        index = [slice(None)] * len(source_shape(source))
        index[dim] = slice(start, stop)
        parts.append(source[tuple(index)])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def read_full(source: TensorSource) -> torch.Tensor:
    return source if isinstance(source, torch.Tensor) else source[:]


@torch.no_grad()
def copy_into(param: torch.Tensor, source: TensorSource, transposed: bool = False) -> None:
    """Fill `param` from the full checkpoint tensor `source`, reading only the part its `shard`
    (a `layers.linear.ShardSpec`) names; zero the padding beyond it. `transposed`: the
    checkpoint stores the 2-D tensor transposed (GPT-2's Conv1D)."""
    spec = getattr(param, "shard", None)
    if spec is None:
        tensor = read_full(source)
        param.copy_(tensor.t() if transposed else tensor)
        return
    dim = 1 - spec.dim if transposed else spec.dim
    tensor = read_ranges(source, dim, spec.ranges)
    if transposed:
        tensor = tensor.t()
    n = spec.size
    param.narrow(spec.dim, 0, n).copy_(tensor)
    if n < param.shape[spec.dim]:
        param.narrow(spec.dim, n, param.shape[spec.dim] - n).zero_()


def expected_shape(param: torch.Tensor, transposed: bool = False) -> tuple[int, ...]:
    """The checkpoint shape `param` is loaded from (the full tensor, for a shard)."""
    spec = getattr(param, "shard", None)
    shape = spec.full_shape(param.shape) if spec is not None else tuple(param.shape)
    return tuple(reversed(shape)) if transposed else shape


def load_named_weights(
    module: nn.Module,
    weights: Iterable[tuple[str, TensorSource]],
    *,
    rename: Callable[[str], str | None],
    transposed: Callable[[str], bool] | None = None,
) -> None:
    """Copy every `(name, tensor)` of `weights` into the parameter `rename(name)` of `module`.

    `rename` maps a checkpoint name to a parameter name of `module`, or to None for tensors to skip
    (rotary buffers, a tied head). `transposed(param_name)` is True for 2-D tensors stored
    transposed (GPT-2's Conv1D). A tensor may be a lazy safetensors slice: a tensor-parallel shard
    then reads only its own rows. Tied parameters count once, under their first name.
    Raises ValueError naming the offenders for unexpected names, shape mismatches and parameters
    the checkpoint did not provide. A `layers.quantization.QuantizedTensor` replaces the weight of
    a linear layer / LM head / embedding by its blocks (else it is dequantized into the parameter).
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for hf_name, source in weights:
        name = rename(hf_name)
        if name is None:
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(hf_name)
            continue
        flip = transposed is not None and transposed(name)
        want = expected_shape(param, flip)
        if source_shape(source) != want:
            raise ValueError(
                f"weight {hf_name!r} has shape {source_shape(source)}, the model expects {want}"
            )
        if _is_quantized(source):
            from pagedserve.layers.quantization import can_quantize, install_quantized_tensor

            if not flip and can_quantize(module, param):
                install_quantized_tensor(module, param, source)  # kept as its blocks
            else:
                copy_into(param, source.dequantize(), flip)
        else:
            copy_into(param, source, flip)
        loaded.add(name)
    if unexpected:
        raise ValueError(f"unexpected weights in checkpoint: {_names(unexpected)}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"weights missing from checkpoint: {_names(missing)}")


def _is_quantized(source: TensorSource) -> bool:
    return type(source).__name__ == "QuantizedTensor" and hasattr(source, "dequantize")


def _names(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")
