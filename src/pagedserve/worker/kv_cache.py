"""The KV cache tensors of one worker: sizing from a memory budget, allocation, block copies."""

from __future__ import annotations

import torch

from pagedserve.models.base import KVCacheSpec


def bytes_per_block(spec: KVCacheSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem


def num_blocks_for_budget(
    spec: KVCacheSpec, block_size: int, dtype: torch.dtype, kv_cache_memory: int
) -> int:
    """How many blocks fit `kv_cache_memory` bytes (the null block included)."""
    n = kv_cache_memory // bytes_per_block(spec, block_size, dtype) - 1
    if n < 1:
        raise ValueError(
            f"kv_cache_memory={kv_cache_memory} bytes holds no KV block of "
            f"{bytes_per_block(spec, block_size, dtype)} bytes (block_size={block_size})"
        )
    return int(n)


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
    ) -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_block = num_blocks
        shape = (num_blocks + 1, block_size, spec.num_kv_heads, spec.head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(spec.num_layers)
        ]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks `src -> dst` in every layer (copy-on-write), one batched op a tensor."""
        device = self.layers[0][0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
        for k, v in self.layers:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def fill_blocks(self, blocks: list[int], value: float) -> None:
        """Overwrite blocks with a value (tests fill freed blocks with NaN to prove paging)."""
        if not blocks:
            return
        idx = torch.tensor(blocks, dtype=torch.long, device=self.layers[0][0].device)
        for k, v in self.layers:
            k.index_fill_(0, idx, value)
            v.index_fill_(0, idx, value)
