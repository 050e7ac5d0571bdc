"""The KV cache tensors of one worker: sizing from a memory budget, allocation, block copies."""

from __future__ import annotations

import torch

from pagedserve.models.base import KVCacheSpec
from pagedserve.platforms import Platform, platform_for


def bytes_per_block(spec: KVCacheSpec, block_size: int, dtype: torch.dtype,
                    draft: KVCacheSpec | None = None) -> int:
    """Bytes one block takes across all layers, K and V; with a draft model's KV spec (`draft`,
    speculative decoding: its cache has the same blocks, worker/spec_draft.py), its part too."""
    elem = torch.empty((), dtype=dtype).element_size()
    extra = bytes_per_block(draft, block_size, dtype) if draft is not None else 0
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem + extra


def num_blocks_for_budget(
    spec: KVCacheSpec, block_size: int, dtype: torch.dtype, kv_cache_memory: int,
    draft: KVCacheSpec | None = None,
) -> int:
    """How many blocks fit `kv_cache_memory` bytes (the null block included; with `draft`, each
    block's draft-model part too: see `bytes_per_block`)."""
    size = bytes_per_block(spec, block_size, dtype, draft)
    n = kv_cache_memory // size - 1
    if n < 1:
        raise ValueError(
            f"kv_cache_memory={kv_cache_memory} bytes holds no KV block of "
            f"{size} bytes (block_size={block_size})"
        )
    return int(n)


def kv_budget_from_profile(total: int, utilization: float, peak: int, block_bytes: int) -> int:
    """KV cache bytes a GPU worker may allocate: `utilization` of the device's `total` memory,
    less the `peak` a profiled forward pass at the largest batch reached (weights, activations,
    logits and memory outside torch's allocator). ValueError when that leaves not even two
    blocks (one usable block and the null block) of `block_bytes`."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total * utilization) - int(peak)
    if budget < 2 * block_bytes:
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} of "
            f"{total / 2**30:.2f} GiB is {total * utilization / 2**30:.2f} GiB, and the model's "
            f"weights and peak activations take {peak / 2**30:.2f} GiB (a KV block takes "
            f"{block_bytes} bytes); raise gpu_memory_utilization, lower max_num_batched_tokens / "
            f"max_num_seqs, or use a smaller model or more tensor-parallel workers")
    return budget


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int) -> float:
    """How many requests of `max_model_len` tokens fit in `num_blocks` blocks at once."""
    return num_blocks * block_size / max_model_len


def preemption_costs(num_params: int, block_bytes: int, device: torch.device | Platform):
    """(seconds to move one block one way, seconds to recompute one token) for `auto` preemption,
    for a worker holding `num_params` parameters and blocks of `block_bytes` (its shard: the
    workers of a tensor-parallel model move and compute their parts side by side).

    Moving a block costs its bytes over the pool-to-pool bandwidth plus a fixed per-block cost
    (the paper's small-transfer overhead); recomputing a token costs ~2 FLOPs per parameter. On
    CPU recomputation is far dearer than a host memory copy, so `auto` swaps; over PCIe the two
    come close at small block sizes, as in the paper's ablation.
    """
    platform = device if isinstance(device, Platform) else platform_for(device)
    bandwidth, per_block, flops = platform.device_figures  # rough figures of the device
    return block_bytes / bandwidth + per_block, 2.0 * num_params / flops


class KVCache:
    """Per layer one K and one V tensor of `[num_blocks + 1, block_size, num_kv_heads, head_dim]`.

    NOTE: block `num_blocks` (the last) is the null block: never handed out by the block pool,
    never written, always zero. Attention pads block tables with it.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_cpu_blocks: int = 0,
        platform: Platform | None = None,
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_block = num_blocks
        shape = (num_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
        # NOTE: uninitialised on purpose (no page is touched until written: a large budget costs
        # nothing up front). Attention never reads a slot before it is written: padding and
        # positions past a sequence's length read the null block, which alone is zeroed.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.empty(shape, dtype=dtype, device=device),
             torch.empty(shape, dtype=dtype, device=device))
            for _ in range(spec.num_layers)
        ]
        for k, v in self.layers:
            k[num_blocks].zero_()
            v[num_blocks].zero_()
        # The CPU swap pool: the same block shape, in host memory (pinned where the platform
        # says: CUDA).
        self.num_cpu_blocks = num_cpu_blocks
        pin = (platform or platform_for(device)).pin_memory
        cpu_shape = (num_cpu_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.cpu_layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.empty(cpu_shape, dtype=dtype, pin_memory=pin),
             torch.empty(cpu_shape, dtype=dtype, pin_memory=pin))
            for _ in range(spec.num_layers)
        ] if num_cpu_blocks else []

    def apply_block_ops(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                        copies: list[tuple[int, int]]) -> None:
        """A step's block operations, in the order SchedulerOutput promises: swap-outs (their
        blocks may be reused by this step's swap-ins and copies), swap-ins, then copy-on-write."""
        if swap_out:
            self.swap_out(swap_out)
        if swap_in:
            self.swap_in(swap_in)
        if copies:
            self.copy_blocks(copies)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks `src -> dst` in every layer (copy-on-write), one batched op a tensor."""
        device = self.layers[0][0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
        for k, v in self.layers:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks, `(device, cpu)` pairs: one gather a tensor."""
        self._transfer(pairs, self.layers, self.cpu_layers)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks, `(cpu, device)` pairs."""
        self._transfer(pairs, self.cpu_layers, self.layers)

    @staticmethod
    def _transfer(pairs, src_layers, dst_layers) -> None:
        src_dev, dst_dev = src_layers[0][0].device, dst_layers[0][0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=src_dev)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst_dev)
        non_blocking = src_dev.type == "cuda" or dst_dev.type == "cuda"
        for (sk, sv), (dk, dv) in zip(src_layers, dst_layers):
            dk.index_copy_(0, dst, sk.index_select(0, src).to(dst_dev, non_blocking=non_blocking))
            dv.index_copy_(0, dst, sv.index_select(0, src).to(dst_dev, non_blocking=non_blocking))

    def fill_blocks(self, blocks: list[int], value: float) -> None:
        """Overwrite blocks with a value (tests fill freed blocks with NaN to prove paging)."""
        if not blocks:
            return
        idx = torch.tensor(blocks, dtype=torch.long, device=self.layers[0][0].device)
        for k, v in self.layers:
            k.index_fill_(0, idx, value)
            v.index_fill_(0, idx, value)
