"""What every model implementation offers to the model runner.

A model reads a flat batch: `input_ids [T]` and `positions [T]` for the T tokens scheduled this
step (all sequences concatenated), plus one `(k_cache, v_cache)` pair per attention layer and the
step's `AttentionMetadata`. It returns hidden states `[T, hidden]`; the runner picks the rows it
samples from and calls `compute_logits` on those only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from pagedserve.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the KV cache a model needs: one K and one V tensor per layer of
    `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class CausalLM(Protocol):
    """The interface of `pagedserve.models.*ForCausalLM` classes.

    Constructors take `(config, *, tp=TPContext())`: with several tensor-parallel ranks the model
    is rank `tp.rank`'s shard, its `kv_cache_spec` counts that rank's KV heads, and
    `compute_logits` returns the logits on rank 0 only (`[S, 0]` on the others).
    """

    kv_cache_spec: KVCacheSpec

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab] fp32
        ...

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [S, hidden] -> [S] int64
        """`compute_logits(hidden).argmax(dim=-1)` computed without fp32 logits where the model
        can (greedy decoding), else None. NOTE: must return None on every tensor-parallel rank
        alike, or the ranks would disagree on calling `compute_logits` (a collective)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as in the HF checkpoint (safetensors names)."""
        ...
