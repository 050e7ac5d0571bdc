"""A recurrent layer's state (Gated DeltaNet, Mamba: a fixed-size state per sequence, rewritten
every step) kept in the paged KV cache.

A state is a few float32 tensors per sequence (`shapes`: e.g. the convolution's last inputs
`[C, L - 1]` and the recurrence's `[H, K, V]`). Its bytes live in `num_entries` cache entries of
the attention layers' page shape (the pool's blocks are all of one size), in the *first logical
block* of the sequence's table in those entries' columns: their group is a
`core.kv_spec.RecurrentStateSpec` group, which holds exactly that one block per sequence for
its life. So swap, recompute preemption (a sequence that restarts has no prior tokens and reads
zeros), copy-on-write forks (n > 1, beam search: a shared state block is copied before the step
writes it) and the memory accounting are the block manager's, unchanged.

A step reads each sequence's state once (`read`: zeros for a sequence with no tokens before
this step), the layer advances it over the sequence's new tokens in place, and `write` stores it
back. NOTE: the layer must advance the state token by token in one fixed order, whatever the
chunking and batch (prefill and decode the same arithmetic): then chunked prefill, preemption
and batching leave tokens and logprobs exactly equal to a roomy run.

NOTE: how many entries a state takes depends on the block size and the cache's storage dtype:
the model learns them from `bind_cache` (models.base) before the engine reads its KV spec.

A model without attention layers (Mamba, Mamba2) has no page shape to follow: its states set
one (`page=None`: `fitted_page`), one entry holding a whole state in blocks of
`FITTED_BLOCK_TOKENS` float32 tokens, and the model declares its state specs with that shape.
"""

from __future__ import annotations

import math

import torch

from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.platforms import OpsUser

KVPair = tuple[torch.Tensor, torch.Tensor]  # one cache entry: K, V `[N + 1, B, Hkv, D]` each

# The block size at which a fitted page (`fitted_page`) holds a float32 state in one entry.
FITTED_BLOCK_TOKENS = 16


def fitted_page(numel: int) -> int:
    """The page (values a token: a K and a V half) of a model whose only cache entries are states
    of `numel` float32 values: one entry of `FITTED_BLOCK_TOKENS` float32 tokens holds a state
    (more entries at smaller blocks or in a 2-byte cache dtype)."""
    return 2 * max(1, -(-numel // (2 * FITTED_BLOCK_TOKENS)))


def entry_bytes(page: int, block_size: int, cache_dtype: torch.dtype) -> int:
    """Bytes of one block of one cache entry: `block_size` tokens of `page` values (K and V of
    a token) in `cache_dtype`."""
    return block_size * page * torch.empty((), dtype=cache_dtype).element_size()


class PagedState(OpsUser, nn.Module):
    """The float32 tensors of `shapes` (per sequence) of one recurrent layer, stored in cache
    entries of `page` values a token (K and V of the attention layers' heads on this rank; None:
    `fitted_page`, for a model without attention; with `tensors=1` one tensor an entry, V None:
    an MLA model's latent page).
    `bind(block_size, cache_dtype)` sets how many entries it takes (`num_entries`). A module
    without parameters (a submodule of its layer): its platform binds the ops that copy a
    state to and from the cache (`LayerOps.paged_state_gather` / `_scatter`; torch otherwise)."""

    def __init__(self, shapes: list[tuple[int, ...]] | tuple[tuple[int, ...], ...], page: int | None,
                 block_size: int = 16, cache_dtype: torch.dtype = torch.float32, tensors: int = 2):
        super().__init__()
        if tensors not in (1, 2):
            raise ValueError(f"a cache entry holds 1 (latent attention's) or 2 (K, V) tensors, got {tensors}")
        self.tensors = tensors
        self.shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        self.sizes = [math.prod(s) for s in self.shapes]
        self.numel = sum(self.sizes)
        if page is None:
            page = fitted_page(self.numel)
        if page < tensors or page % tensors:
            raise ValueError(f"a cache page must hold {tensors} equal tensors' values, got {page}")
        self.page = page
        self.bind(block_size, cache_dtype)

    def bind(self, block_size: int, cache_dtype: torch.dtype) -> int:
        """Fit the state to blocks of `block_size` tokens stored in `cache_dtype`; returns the
        cache entries it takes."""
        per_entry = entry_bytes(self.page, block_size, cache_dtype)
        self.num_entries = -(-(self.numel * 4) // per_entry)
        return self.num_entries

    @staticmethod
    def _flat(cache: torch.Tensor) -> torch.Tensor:  # [N + 1, 32-bit words of a block]
        # NOTE: copied as 32-bit words, never bytes: torch's uint8 index_select / index_copy_
        # run ~50x slower (a state is MBs a sequence a layer)
        words = cache.view(torch.uint8).view(cache.shape[0], -1)
        if words.shape[1] % 4:
            raise ValueError(f"a cache block of {words.shape[1]} bytes cannot hold a float32 state")
        return words.view(torch.int32)

    @staticmethod
    def _blocks(meta: AttentionMetadata) -> torch.Tensor:  # [S]
        # NOTE: an entry's state block is logical block 0 of ITS column: the entries of one
        # layer may sit in several columns (lanes), each with its own blocks
        return meta.block_tables[:, 0]

    def read(self, caches: list[KVPair], metas: list[AttentionMetadata]) -> list[torch.Tensor]:
        """Each sequence's state before this step: one float32 tensor `[S, *shape]` per shape
        (a copy: the layer may update it in place), zeros for a sequence whose first token is
        in this step."""
        if len(caches) != self.num_entries:
            raise ValueError(f"a recurrent state of {self.numel} values takes {self.num_entries} "
                             f"cache entries here, got {len(caches)}")
        values = self.gather(caches, metas, 0, self.numel)  # [S, numel]
        return [v.reshape(values.shape[0], *shape) for v, shape
                in zip(values.split(self.sizes, dim=1), self.shapes)]

    def offset(self, i: int) -> int:
        """Where tensor `i` of `shapes` starts in a state (values)."""
        return sum(self.sizes[:i])

    def paged(self, caches: list[KVPair], metas: list[AttentionMetadata]):
        """What the in-place kernels take (`kernels.cpu_recurrent.*_paged`): the entries' K / V
        tensors in state order, each entry's block of each sequence `[E, S]`, and which
        sequences are fresh `[S]`."""
        return self.flat_caches(caches), self.block_ids(metas), self.fresh(metas)

    @staticmethod
    def fresh(metas: list[AttentionMetadata]) -> torch.Tensor:  # [S] bool
        """Which sequences have no token before this step (their state starts at zero)."""
        meta = metas[0]
        return meta.seq_lens == meta.query_start_loc[1:] - meta.query_start_loc[:-1]

    @staticmethod
    def block_ids(metas: list[AttentionMetadata]) -> torch.Tensor:  # [E, S] int64
        """Each entry's state block of each sequence (logical block 0 of its column): one index
        of the state columns' shared first blocks (`AttentionBatch.state_columns`), kept on the
        first entry's metadata for the layer's other calls this step; else one per entry."""
        firsts = getattr(metas[0], "state_firsts", None)
        if firsts is None or any(getattr(m, "state_firsts", None) is not firsts for m in metas):
            return torch.stack([PagedState._blocks(m) for m in metas])
        cols = tuple(m.state_column for m in metas)
        cached = metas[0].__dict__.get("_state_block_ids")
        if cached is None or cached[0] != cols:
            index = torch.tensor(cols, dtype=torch.int64, device=firsts.device)
            cached = (cols, firsts.index_select(1, index).t().contiguous())  # [E, S]
            metas[0].__dict__["_state_block_ids"] = cached
        return cached[1]

    def flat_caches(self, caches: list[KVPair]) -> list[torch.Tensor]:
        """The entries' K and V tensors in state order (K of entry 0, V of entry 0, K of 1 ...;
        with `tensors=1`, an MLA model's entries: K alone)."""
        return [t for pair in caches for t in pair[: self.tensors]]

    def gather(self, caches: list[KVPair], metas: list[AttentionMetadata], start: int,
               count: int) -> torch.Tensor:  # [S, count] float32
        """Values `[start, start + count)` of each sequence's state (zeros for a fresh one)."""
        return self._gather(caches, metas, start, count, self.fresh(metas))

    def _gather(self, caches, metas, start: int, count: int, fresh: torch.Tensor) -> torch.Tensor:
        got = self.ops.paged_state_gather(self.flat_caches(caches), self.block_ids(metas), start,
                                          count, fresh)
        if got is not None:
            return got
        parts = [self._flat(t).index_select(0, self._blocks(m))
                 for pair, m in zip(caches, metas) for t in pair[: self.tensors]]
        raw = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [S, words]
        values = raw[:, start : start + count].contiguous().view(torch.float32)  # [S, count]
        return values.masked_fill(fresh[:, None], 0.0)

    def write(self, caches: list[KVPair], metas: list[AttentionMetadata],
              states: list[torch.Tensor]) -> None:
        """Store each sequence's state after this step (`states` as `read` returned them)."""
        n = states[0].shape[0]
        values = torch.cat([s.reshape(n, -1).float() for s in states], dim=1)
        self.scatter(caches, metas, 0, values)

    def scatter(self, caches: list[KVPair], metas: list[AttentionMetadata], start: int,
                values: torch.Tensor) -> None:
        """Store `values [S, count]` as values `[start, start + count)` of each state."""
        if self.ops.paged_state_scatter(self.flat_caches(caches), self.block_ids(metas), start,
                                        values):
            return
        if start or values.shape[1] != self.numel:  # (the torch path stores whole states)
            stale = torch.zeros_like(self.fresh(metas))  # (as stored: parts written this step)
            full = self._gather(caches, metas, 0, self.numel, stale)
            full[:, start : start + values.shape[1]] = values
            values = full
        raw = values.contiguous().view(torch.int32)  # [S, numel]
        width = self._flat(caches[0][0]).shape[1]
        total = width * self.tensors * len(caches)
        if raw.shape[1] < total:
            raw = torch.nn.functional.pad(raw, (0, total - raw.shape[1]))
        chunks = raw.split(width, dim=1)
        i = 0
        for pair, meta in zip(caches, metas):
            blocks = self._blocks(meta)
            for t in pair[: self.tensors]:
                self._flat(t).index_copy_(0, blocks, chunks[i])
                i += 1
