"""Megatron-style tensor-parallel layers. With one rank each computes what its torch
counterpart (`nn.Linear` / `nn.Embedding`) does; products go through the layer's `ops.linear`,
the platform's choice (`platforms`; bound by `Platform.bind`): on the CPU platform float32 runs
the batch-invariant kernel of `kernels.cpu_fp32` (a row's bits do not depend on the batch) and
BF16 activations our compiled kernel (any batch size; bf16 or quantized weights:
`layers.quantization`); on CUDA it is `F.linear`.

- `ColumnParallelLinear`: each rank holds a slice of the output features (no communication);
  fused outputs (q|k|v) are sliced per part.
- `RowParallelLinear`: each rank holds a slice of the input features; partial products are summed
  over the ranks (all-reduce), then the bias is added once.
- `VocabParallelEmbedding` / `ParallelLMHead`: each rank holds `ceil(vocab / ranks)` rows of the
  vocabulary; lookups outside the slice give zeros and are summed over the ranks, logits are
  gathered on rank 0 (the rank that samples).

Every sharded parameter carries a `ShardSpec` (attribute `shard`) saying which part of the
checkpoint tensor it holds; `layers.weights.load_named_weights` reads only that part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.platforms import DEFAULT_OPS, OpsUser


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           ops=DEFAULT_OPS) -> torch.Tensor:
    """`F.linear(x, weight, bias)` on the platform's `ops` (default: `platforms.DEFAULT_OPS`).
    NOTE: every product of the model must come through a layer's ops (LM head included), or a
    float32 row's logits would again depend on the batch it is in."""
    return ops.linear(x, weight, bias)


@dataclass(frozen=True)
class ShardSpec:
    """The part of a checkpoint tensor a parameter holds: along `dim`, the concatenation of the
    ranges `[start, stop)` of the full tensor, whose size along `dim` is `full_size`. Rows of the
    parameter beyond the ranges' total (vocabulary padding) are zero."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full_size: int

    @property
    def size(self) -> int:
        return sum(stop - start for start, stop in self.ranges)

    def full_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The checkpoint tensor's shape, from the parameter's."""
        full = list(shape)
        full[self.dim] = self.full_size
        return tuple(full)


def set_shard(param: nn.Parameter | None, spec: ShardSpec) -> None:
    if param is not None:
        param.shard = spec


class ColumnParallelLinear(OpsUser, nn.Linear):
    """`y = x W^T + b` with this rank's slice of the output features.

    `output_sizes` lists the parts of a fused output (e.g. q, k, v); each is cut into `count`
    equal pieces and the rank holds piece `index` of every part, by default `(tp.rank,
    tp.world_size)`. KV projections with fewer heads than ranks pass `tp.kv_head_part(...)`.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: int | Sequence[int],
        bias: bool = True,
        *,
        tp: TPContext = SINGLE,
        part: tuple[int, int] | None = None,
    ) -> None:
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        index, count = part if part is not None else (tp.rank, tp.world_size)
        for size in sizes:
            if size % count:
                raise ValueError(f"output features ({size}) must be divisible by {count} ranks")
        super().__init__(in_features, sum(sizes) // count, bias=bias)
        self.tp = tp
        if count > 1:
            ranges, offset = [], 0
            for size in sizes:
                piece = size // count
                ranges.append((offset + index * piece, offset + (index + 1) * piece))
                offset += size
            spec = ShardSpec(0, tuple(ranges), offset)
            set_shard(self.weight, spec)
            set_shard(self.bias, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out / N]
        return self.ops.linear(x, self.weight, self.bias)


def fuse_linears(linears: Sequence[nn.Module]) -> bool:
    """Re-home the weights (and biases) of `ColumnParallelLinear`s that read one input (q, k, v;
    gate, up) into one buffer, each keeping a view of its rows, so that `linear_outputs` runs
    them as one product: one launch and one wider GEMM (the CUDA platform does this after
    loading; `Platform.bind`). Returns False, touching nothing, where they cannot share one
    (another layer type, e.g. a LoRA wrapper; mixed dtypes, devices, input widths or biases).

    NOTE: no memory is added: the old tensors are freed once the views replace them. The
    buffer is remembered with the views' addresses: a later load that replaces a parameter
    (rather than copying into it) silently turns the group back into separate products."""
    if len(linears) < 2 or any(type(m) is not ColumnParallelLinear for m in linears):
        return False
    first = linears[0].weight
    if any(m.weight.dtype != first.dtype or m.weight.device != first.device
           or m.weight.shape[1] != first.shape[1] for m in linears):
        return False
    with_bias = [m.bias is not None for m in linears]
    if any(with_bias) and not all(with_bias):
        return False
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears])  # [sum N, K]
        bias = torch.cat([m.bias.detach() for m in linears]) if all(with_bias) else None
    sizes, start = [], 0
    for m in linears:
        n = m.weight.shape[0]
        for name, buf in (("weight", weight), ("bias", bias)):
            old = getattr(m, name)
            if old is None:
                continue
            new = nn.Parameter(buf[start:start + n], requires_grad=False)
            new.__dict__.update(old.__dict__)  # the shard spec
            setattr(m, name, new)
        sizes.append(n)
        start += n
    linears[0].__dict__["_fused"] = (weight, bias, tuple(sizes),
                                     tuple(m.weight.data_ptr() for m in linears))
    return True


class FusableLinears:
    """Mixin of a module whose projections read one input in groups (`fusable_linears()`:
    q/k/v, gate/up): `fuse_linear_groups()` re-homes each group into one buffer, which a platform
    calls after loading (`platforms.cuda.CudaPlatform.bind`) without knowing the module."""

    def fusable_linears(self) -> tuple[tuple[nn.Module, ...], ...]:
        raise NotImplementedError

    def fuse_linear_groups(self) -> None:
        for group in self.fusable_linears():
            fuse_linears(group)


def linear_outputs(x: torch.Tensor, linears: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """Each of `linears`' output for `x` (`[T, K]` -> `[T, N_i]` each): one product over their
    shared buffer where `fuse_linears` made one (the outputs are then column views of one
    `[T, sum N]` tensor), else one product each."""
    fused = linears[0].__dict__.get("_fused")
    if fused is not None and all(type(m) is ColumnParallelLinear for m in linears) and (
            fused[3] == tuple(m.weight.data_ptr() for m in linears)):
        weight, bias, sizes, _ = fused
        return linears[0].ops.linear(x, weight, bias).split(sizes, dim=-1)
    return tuple(m(x) for m in linears)


class RowParallelLinear(OpsUser, nn.Linear):
    """`y = x W^T + b` where this rank holds a slice of the input features: the partial products
    are summed over the ranks, then the bias is added (once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 tp: TPContext = SINGLE) -> None:
        local = tp.split(in_features, "input features")
        super().__init__(local, out_features, bias=bias)
        self.tp = tp
        if tp.is_parallel:
            start = tp.rank * local
            set_shard(self.weight, ShardSpec(1, ((start, start + local),), in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / N] -> [T, out]
        if not self.tp.is_parallel:
            return self.ops.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(self.ops.linear(x, self.weight))  # [T, out], summed over ranks
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(OpsUser, nn.Embedding):
    """Token embeddings, this rank holding rows `[start, stop)` of the vocabulary (padded to
    `ceil(vocab / ranks)` rows)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TPContext = SINGLE) -> None:
        start, stop, rows = tp.vocab_range(num_embeddings)
        super().__init__(rows, embedding_dim)
        self.tp = tp
        self.vocab_size = num_embeddings
        self.vocab_start, self.vocab_stop = start, stop
        if tp.is_parallel:
            set_shard(self.weight, ShardSpec(0, ((start, stop),), num_embeddings))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, E]
        if getattr(self.weight, "quant", None) is not None:  # quantized rows (one rank)
            return self.ops.quantized_embedding(input_ids, self.weight)
        if not self.tp.is_parallel:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_stop)  # [T]
        local = torch.where(mine, input_ids - self.vocab_start, 0)  # [T]
        x = F.embedding(local, self.weight).masked_fill(~mine.unsqueeze(-1), 0.0)  # [T, E]
        return self.tp.all_reduce(x)


class ParallelLMHead(OpsUser, nn.Linear):
    """Logits over the vocabulary (no bias), this rank computing its vocabulary slice; the slices
    are gathered on rank 0. Tie it to a `VocabParallelEmbedding` of the same `tp` by sharing the
    weight.

    NOTE: only rank 0 gets the logits; the other ranks get `[S, 0]` (they do not sample).
    """

    def __init__(self, embedding_dim: int, num_embeddings: int, *, tp: TPContext = SINGLE) -> None:
        start, stop, rows = tp.vocab_range(num_embeddings)
        super().__init__(embedding_dim, rows, bias=False)
        self.tp = tp
        self.vocab_size = num_embeddings
        if tp.is_parallel:
            set_shard(self.weight, ShardSpec(0, ((start, stop),), num_embeddings))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, E] -> [S, V] (rank 0)
        if not self.tp.is_parallel:
            return self.ops.linear(x, self.weight)
        if x.shape[0] == 0:  # every rank has the same rows: all skip the collective together
            return x.new_zeros(0, self.vocab_size if self.tp.rank == 0 else 0)
        logits = self.tp.gather_to_first(self.ops.linear(x, self.weight))  # [S, rows * N] on rank 0
        if logits is None:
            return x.new_empty(x.shape[0], 0)  # [S, 0]
        return logits[:, : self.vocab_size]

    def greedy(self, x: torch.Tensor) -> torch.Tensor | None:  # [S, E] -> [S] int64
        """`forward(x).float().argmax(dim=-1)` (the first maximum; a NaN counts as the maximum)
        without fp32 logits where the platform's ops can (`LayerOps.greedy`: the CPU's bf16
        argmax scan); None where they do not (tensor parallel, not bf16 on CPU, kernels
        unavailable): the caller computes logits.
        """
        if self.tp.is_parallel:
            return None
        return self.ops.greedy(x, self.weight)
