"""The KV cache tensors of one worker: sizing from a memory budget, allocation, block copies."""

from __future__ import annotations

import torch

from pagedserve.attention.kv_dtype import as_bytes, fill_value
from pagedserve.core.kv_spec import KVLayout
from pagedserve.models.base import KVCacheSpec
from pagedserve.platforms import Platform, platform_for


def kv_layout(spec: KVCacheSpec, hybrid: bool = True) -> KVLayout:
    """How the model's layers share the pool's blocks (core/kv_spec.py): its layer groups
    (sliding-window, full, latent attention) with `hybrid`, else one group of full attention."""
    return KVLayout.from_specs(spec.layer_specs(), hybrid)


def held_slots(spec: KVCacheSpec, layout: KVLayout) -> list[tuple[int, ...]]:
    """Per pipeline stage of `spec` (`KVCacheSpec.stages`; one entry, every layer, without
    stages), the layer slots of `layout` its layers sit in: the slot tensors its worker
    allocates.

    NOTE: every stage sees the whole model's layout, so the scheduler's block tables (every
    group's columns) hold on all stages unchanged; a block id is backed on each stage by the
    slots of that stage's layers only. A stage whose layers share a slot with another stage's
    (a hybrid layout's lane spanning the cut) allocates that slot too."""
    stages = spec.stages or ((0, layout.num_layers),)
    for first, last in stages:
        if not 0 <= first < last <= layout.num_layers:
            raise ValueError(f"KVCacheSpec.stages: layers [{first}, {last}) outside the model's "
                             f"{layout.num_layers} layers")
    return [tuple(sorted({layout.layer_slot[i] for i in range(first, last)}))
            for first, last in stages]


def bytes_per_block(spec: KVCacheSpec, block_size: int, dtype: torch.dtype,
                    draft: KVCacheSpec | None = None, hybrid: bool = True) -> int:
    """Bytes one pool block takes on one worker: `block_size` tokens of the layers one block
    holds (every layer with one group; a lane of a group with several, see `kv_layout`; with
    pipeline stages, those of the stage holding the most slots, see `held_slots`) in the cache's
    storage `dtype` (fp8: one byte per value, `attention.kv_dtype`); with a draft
    model's KV spec (`draft`, speculative decoding: its cache has the same blocks,
    worker/spec_draft.py), its part too."""
    elem = torch.empty((), dtype=dtype).element_size()
    extra = bytes_per_block(draft, block_size, dtype, hybrid=False) if draft is not None else 0
    layout = kv_layout(spec, hybrid)
    per_slot = layout.bytes_per_block(block_size, elem) // layout.slots
    return per_slot * max(len(s) for s in held_slots(spec, layout)) + extra


def num_blocks_for_budget(
    spec: KVCacheSpec, block_size: int, dtype: torch.dtype, kv_cache_memory: int,
    draft: KVCacheSpec | None = None, hybrid: bool = True,
) -> int:
    """How many blocks fit `kv_cache_memory` bytes (the null block included; with `draft`, each
    block's draft-model part too: see `bytes_per_block`)."""
    size = bytes_per_block(spec, block_size, dtype, draft, hybrid)
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


def max_concurrency(num_blocks: int, block_size: int, max_model_len: int,
                    layout: KVLayout | None = None, chunk: int | None = None) -> float:
    """How many requests of `max_model_len` tokens fit in `num_blocks` blocks at once (vLLM's
    "Maximum concurrency"): with a `layout`, the blocks one such request holds at its peak when
    a step computes at most `chunk` tokens (`KVLayout.blocks_per_request`)."""
    if layout is None:
        return num_blocks * block_size / max_model_len
    per_request = layout.blocks_per_request(max_model_len, block_size, chunk or max_model_len)
    return num_blocks / per_request


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
    """The pool's blocks as tensors: per layer slot of a block (`layout.slots`) one K and one V
    tensor of `[num_blocks + 1, block_size, num_kv_heads, head_dim]` in the storage `dtype` (the
    model's, or fp8 with `kv_cache_dtype`: `attention.kv_dtype`) (a latent-attention model:
    one tensor `[num_blocks + 1, block_size, 1, latent_dim]`, V None). `layers[l]` is model
    layer `l`'s pair: its slot's tensors, read through its column of the block tables
    (`layout.layer_column`). One group (`hybrid=False`, or a uniform model): one slot per layer,
    the table's one column. A pipeline stage's cache (`KVCacheSpec.stages`) allocates only its
    layers' slots: the others, and so the other stages' `layers[l]`, are `(None, None)`.

    NOTE: block `num_blocks` (the last) is the null block: never handed out by the block pool,
    never written, always zero. Attention pads block tables with it, and the tables of a
    sliding-window group hold it where the window gave a block back.
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
        hybrid: bool = True,
    ) -> None:
        self.spec = spec
        self.layout = kv_layout(spec, hybrid)
        self.width = self.layout.width
        # Each column's window (None: full), or None when no column slides (its blocks are all
        # kept: the metadata passes whole tables).
        windows = self.layout.column_windows()
        self.column_windows = windows if any(windows) else None
        self.state_columns = self.layout.state_columns()  # (their metadata: logical block 0)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.null_block = num_blocks
        page = self.layout.page_spec
        tensors, heads, head_dim = page.page_shape()
        shape = (num_blocks + 1, block_size, heads, head_dim)

        # The slots this worker holds: all, or a pipeline stage's (`held_slots`); the others
        # stay (None, None) and its layers never read them.
        held = {u for stage in held_slots(spec, self.layout) for u in stage}
        self.device = torch.device(device)

        def pair(u, shape, **kw):
            if u not in held:
                return (None, None)
            return (torch.empty(shape, dtype=dtype, **kw),
                    torch.empty(shape, dtype=dtype, **kw) if tensors == 2 else None)

        # NOTE: uninitialised on purpose (no page is touched until written: a large budget costs
        # nothing up front). Attention never reads a slot before it is written: padding and
        # positions past a sequence's length read the null block, which alone is zeroed.
        self.slots: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [
            pair(u, shape, device=device) for u in range(self.layout.slots)]
        for t in _tensors(self.slots):
            t[num_blocks].zero_()
        self.layers = [self.slots[u] for u in self.layout.layer_slot]
        # The CPU swap pool: the same block shape, in host memory (pinned where the platform
        # says: CUDA).
        self.num_cpu_blocks = num_cpu_blocks
        pin = (platform or platform_for(device)).pin_memory
        cpu_shape = (num_cpu_blocks, block_size, heads, head_dim)
        self.cpu_slots = [pair(u, cpu_shape, pin_memory=pin)
                          for u in range(self.layout.slots)] if num_cpu_blocks else []

    @property
    def cpu_layers(self) -> list:
        """Model layer `l`'s CPU swap tensors (its slot's)."""
        return [self.cpu_slots[u] for u in self.layout.layer_slot] if self.cpu_slots else []

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
        """Copy whole blocks `src -> dst` in every slot tensor (copy-on-write), one batched op a
        tensor."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        for t in _tensors(self.slots):
            t = as_bytes(t)  # fp8: torch has no index_copy_ for it (the bytes are the same)
            t.index_copy_(0, dst, t.index_select(0, src))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to CPU blocks, `(device, cpu)` pairs: one gather a tensor."""
        self._transfer(pairs, self.slots, self.cpu_slots)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy CPU blocks back to device blocks, `(cpu, device)` pairs."""
        self._transfer(pairs, self.cpu_slots, self.slots)

    @staticmethod
    def _transfer(pairs, src_slots, dst_slots) -> None:
        src_dev, dst_dev = _tensors(src_slots)[0].device, _tensors(dst_slots)[0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=src_dev)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst_dev)
        # asynchronous where a device's queue orders the copy (pinned host blocks on one side)
        non_blocking = not (platform_for(src_dev).is_host and platform_for(dst_dev).is_host)
        for s, d in zip(_tensors(src_slots), _tensors(dst_slots)):
            s, d = as_bytes(s), as_bytes(d)
            d.index_copy_(0, dst, s.index_select(0, src).to(dst_dev, non_blocking=non_blocking))

    def fill_blocks(self, blocks: list[int], value: float) -> None:
        """Overwrite blocks with a value (tests fill freed blocks with NaN to prove paging)."""
        if not blocks:
            return
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        for t in _tensors(self.slots):
            as_bytes(t).index_fill_(0, idx, fill_value(t.dtype, value))


def _tensors(slots):
    """Every tensor of the slots (K, then V where there is one; none of a slot this worker does
    not hold)."""
    return [t for pair in slots for t in pair if t is not None]
