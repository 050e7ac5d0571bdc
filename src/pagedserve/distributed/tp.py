"""A worker's place in tensor parallelism: its rank, the world size and the process group, passed
explicitly to every parallel layer (no global state). Collectives go through torch.distributed
(gloo on CPU, NCCL on CUDA); with one rank they are no-ops."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TPContext:
    """Rank `rank` of `world_size` tensor-parallel ranks, joined by `group`.

    `group` is a torch.distributed process group, or None with one rank (and when a model is only
    built to read its shapes: layers never touch the group while they are constructed).
    `reduce_in_float32`: sum 16-bit tensors as float32 (gloo's bfloat16 sum is slow and rounds
    every partial sum; NCCL sums 16-bit tensors natively).
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None
    reduce_in_float32: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside [0, {self.world_size})")

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    # --- partitioning ------------------------------------------------------------------------

    def split(self, size: int, what: str) -> int:
        """This rank's equal share of `size` (heads, columns); ValueError unless it divides."""
        if size % self.world_size:
            raise ValueError(
                f"{what} ({size}) must be divisible by tensor_parallel_size ({self.world_size})"
            )
        return size // self.world_size

    def kv_head_part(self, num_kv_heads: int) -> tuple[int, int]:
        """(index, count): the KV heads are cut into `count` equal parts and this rank holds part
        `index`. With fewer KV heads than ranks each rank holds one head, replicated on
        `world_size / num_kv_heads` ranks: the head its query heads read."""
        n = self.world_size
        if num_kv_heads >= n:
            self.split(num_kv_heads, "num_key_value_heads")
            return self.rank, n
        if n % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size ({n}) must be a multiple of num_key_value_heads "
                f"({num_kv_heads}) when it is larger"
            )
        return self.rank * num_kv_heads // n, num_kv_heads

    def local_kv_heads(self, num_kv_heads: int) -> int:
        """KV heads this rank holds (and caches): see `kv_head_part`."""
        return num_kv_heads // self.kv_head_part(num_kv_heads)[1]

    def vocab_range(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, stop, rows): this rank's vocabulary slice `[start, stop)` and its padded row
        count `ceil(vocab / world_size)` (the last rank's padding rows stay zero)."""
        rows = cdiv(vocab_size, self.world_size)
        start = min(self.rank * rows, vocab_size)
        return start, min(start + rows, vocab_size), rows

    # --- collectives -------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks; returns the sum (`x` itself, summed in place, unless it is
        summed as float32)."""
        if self.world_size == 1:
            return x
        if self.reduce_in_float32 and x.dtype in (torch.bfloat16, torch.float16):
            wide = x.float()
            dist.all_reduce(wide, group=self.group)
            return wide.to(x.dtype)
        dist.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:  # [S, n] -> [S, n * N]
        """Every rank's `x` concatenated along the last dimension, in rank order, on rank 0;
        None on the other ranks."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None


SINGLE = TPContext()
