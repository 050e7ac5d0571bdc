"""Copying HF-named checkpoint tensors into a model's parameters, strictly, shard by shard."""

from __future__ import annotations

import dataclasses

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
    if isinstance(source, torch.Tensor):
        return source
    return source[:] if source_shape(source) else source[()]  # (a 0-dim slice takes no slice)


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
    (rotary buffers, a tied head), or to `(name, i)` with an int `i`: the tensor is slice `i`
    (dim 0) of the stacked parameter (an MoE layer's experts, loaded one by one; the parameter
    counts as loaded once every slice is), or to `(name, slice)`: the parameter is those rows of
    the tensor (a rank's experts of a stacked checkpoint tensor). `transposed(param_name)` is True for 2-D tensors stored
    transposed (GPT-2's Conv1D). A tensor may be a lazy safetensors slice: a tensor-parallel shard
    then reads only its own rows. Tied parameters count once, under their first name.
    Raises ValueError naming the offenders for unexpected names, shape mismatches and parameters
    the checkpoint did not provide. A `layers.quantization.QuantizedTensor` replaces the weight of
    a linear layer / LM head / embedding by its blocks (else it is dequantized into the parameter).
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    slices: dict[str, set[int]] = {}  # stacked parameters loaded slice by slice
    packed: dict[int, Any] = {}  # id(stacked parameter kept as blocks) -> its first slice
    unexpected: list[str] = []
    for hf_name, source in weights:
        name = rename(hf_name)
        if name is None:
            continue
        part = None
        if isinstance(name, tuple):  # a stacked parameter's slice (an MoE layer's experts)
            name, part = name
        param = params.get(name)
        if param is None:
            unexpected.append(hf_name)
            continue
        if isinstance(part, int):
            params[name] = _copy_slice(module, hf_name, param, part, source, slices.get(name, set()), packed)
            slices.setdefault(name, set()).add(part)
            if len(slices[name]) == param.shape[0]:
                loaded.add(name)
            continue
        if part is not None:  # the parameter is rows `part` of the checkpoint tensor
            source = _rows(hf_name, source, part, param)
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


def _copy_slice(module: nn.Module, hf_name: str, param: torch.Tensor, index: int, source: TensorSource,
                filled: set[int], packed: dict[int, Any]) -> torch.Tensor:
    """Copy checkpoint tensor `source` into slice `index` (dim 0) of the stacked `param`, reading
    only the part its `shard` (a `ShardSpec` of the stacked parameter, dim >= 1) names; returns
    the parameter now holding the stack (`module`'s, which may have replaced `param`).

    Quantized slices (an AWQ / GPTQ / compressed-tensors / FP8 checkpoint's experts, one by one)
    keep their blocks when the stack may stay quantized (`layers.quantization.can_quantize`: an
    MoE layer's experts on one rank): the first one replaces `param` by a uint8 stack
    `[E, N, row_bytes]` of its format, the others fill its slices. Each slice keeps its own
    input order (GPTQ act-order: `perm`), in the stack's `[E, K]` `QuantSpec.perm` (see
    `_set_order`). `filled`: the slices already loaded; `packed`: the stacks kept so far (id ->
    first slice).

    NOTE: one stack has one format. A slice that does not fit it (another format, a float
    tensor) turns the stack back into floats: the slices loaded so far dequantized, the rest
    copied as they come."""
    from pagedserve.layers.linear import ShardSpec

    qspec = getattr(param, "quant", None)
    want = (param.shape[1], qspec.in_features) if qspec is not None else expected_shape(param)[1:]
    if source_shape(source) != want:
        raise ValueError(f"weight {hf_name!r} has shape {source_shape(source)}, the model expects {want}")
    if qspec is not None:
        if _is_quantized(source) and source.format == qspec.format:
            param[index].copy_(source.data)
            _set_order(param, index, source.perm)
            return param
        param = _unpack_stack(module, param, filled, packed.pop(id(param)))
    elif _is_quantized(source) and not filled:
        from pagedserve.layers.quantization import can_quantize, install_quantized_tensor

        if can_quantize(module, param):
            stack = type(source)(torch.zeros(param.shape[0], *source.data.shape, dtype=torch.uint8), source.format,
                                 (param.shape[0], *source.shape), source.ggml_type, dequantizer=source.dequantizer)
            stack.data[index].copy_(source.data)
            new = install_quantized_tensor(module, param, stack)
            _set_order(new, index, source.perm)
            packed[id(new)] = source
            return new
    if _is_quantized(source):
        source = source.dequantize()
    spec = getattr(param, "shard", None)
    target = param[index]
    if spec is not None:
        target.shard = ShardSpec(spec.dim - 1, spec.ranges, spec.full_size)
    copy_into(target, source)
    return param


def _set_order(stack: torch.Tensor, index: int, perm: torch.Tensor | None) -> None:
    """Record slice `index`'s input-feature order (`QuantizedTensor.perm`, None: the
    checkpoint's) in the quantized stack's spec: its `perm` stays None while every slice is in
    the checkpoint's order, and becomes `[E, K]` (identity rows for the others) with the first
    slice that is not."""
    spec = stack.quant
    if perm is None and spec.perm is None:
        return
    if spec.perm is None:
        orders = torch.arange(spec.in_features).repeat(stack.shape[0], 1)  # [E, K]
        stack.quant = spec = dataclasses.replace(spec, perm=orders)
    spec.perm[index] = torch.arange(spec.in_features) if perm is None else perm


@torch.no_grad()
def _unpack_stack(module: nn.Module, stack: torch.Tensor, filled: set[int], first: Any) -> nn.Parameter:
    """Replace the quantized stack `stack` (in every module holding it) by a float parameter of
    its model dtype with slices `filled` dequantized; returns the new parameter."""
    spec = stack.quant
    n, k = stack.shape[1], spec.in_features
    dense = nn.Parameter(torch.zeros(stack.shape[0], n, k, dtype=spec.dtype))
    for e in filled:
        part = type(first)(stack.data[e], spec.format, (n, k), first.ggml_type,
                           perm=None if spec.perm is None else spec.perm[e], dequantizer=first.dequantizer)
        dense[e].copy_(part.dequantize())
    from pagedserve.layers.quantization import owners_of

    for owner, key in owners_of(module, stack):
        owner._parameters[key] = dense
    return dense


def _rows(hf_name: str, source: TensorSource, rows: slice, param: torch.Tensor) -> TensorSource:
    """Rows `rows` (dim 0) of checkpoint tensor `source`, for a parameter holding only those (an
    MoE layer's experts under expert parallelism)."""
    if _is_quantized(source):
        source = source.dequantize()
    full = source_shape(source)
    if rows.stop > full[0]:
        raise ValueError(f"weight {hf_name!r} has {full[0]} rows, the model reads {rows.start}:{rows.stop}")
    return read_full(source)[rows] if isinstance(source, torch.Tensor) else source[rows]


def _is_quantized(source: TensorSource) -> bool:
    return type(source).__name__ == "QuantizedTensor" and hasattr(source, "dequantize")


def _names(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


class _RowSlice:
    """Rows [start, stop) of a lazy checkpoint tensor, itself read lazily (a shard reads only
    its rows of the fused tensor)."""

    def __init__(self, source: TensorSource, start: int, stop: int):
        self.source, self.start, self.stop = source, start, stop

    def get_shape(self) -> tuple[int, ...]:
        return (self.stop - self.start, *source_shape(self.source)[1:])

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        rows = index[0] if index else slice(None)
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise ValueError("a row slice of a checkpoint tensor takes plain slices only")
        first, last, _ = rows.indices(self.stop - self.start)
        return self.source[(slice(self.start + first, self.start + last), *index[1:])]


def split_rows(source: TensorSource, sizes: list[int]) -> list[TensorSource]:
    """A fused checkpoint tensor (Phi-3's `qkv_proj`, `gate_up_proj`) as consecutive row blocks of
    `sizes` rows: views of a tensor, lazy slices of a lazy one, row blocks of a quantized one
    (`layers.quantization.QuantizedTensor`: its rows are whole rows of blocks). ValueError when
    the sizes do not add up to its rows."""
    rows = source_shape(source)[0]
    if sum(sizes) != rows:
        raise ValueError(f"a fused tensor of {rows} rows does not split into {sizes}")
    parts, start = [], 0
    for n in sizes:
        if isinstance(source, torch.Tensor):
            parts.append(source[start:start + n])
        elif _is_quantized(source):
            parts.append(type(source)(source.data[start:start + n], source.format,
                                      (n, *source.shape[1:]), source.ggml_type, perm=source.perm,
                                      dequantizer=source.dequantizer))
        else:
            parts.append(_RowSlice(source, start, start + n))
        start += n
    return parts


def split_fused_weights(weights: Iterable[tuple[str, TensorSource]],
                        fused: dict[str, Callable[[], list[tuple[str, int]]]]):
    """Yield `weights` with each fused tensor split: a name `...<fused key>.<weight|bias>` becomes
    one tensor per `(part name, rows)` of `fused[key]()`, named `...<part name>.<weight|bias>`."""
    for name, source in weights:
        stem, _, suffix = name.rpartition(".")
        key = next((k for k in fused if stem == k or stem.endswith("." + k)), None)
        if key is None:
            yield name, source
            continue
        prefix = stem[: len(stem) - len(key)]
        parts = fused[key]()
        for (part, _), tensor in zip(parts, split_rows(source, [n for _, n in parts])):
            yield f"{prefix}{part}.{suffix}", tensor
