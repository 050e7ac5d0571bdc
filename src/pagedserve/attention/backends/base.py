"""The interface of an attention backend and the batch its metadata is built from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pagedserve.attention.metadata import AttentionMetadata


@dataclass
class AttentionBatch:
    """One step's sequences as host lists, in flat-batch order (see `AttentionMetadata.build`):
    block tables, context lengths after the step, query lengths; the cache's geometry."""

    block_tables: list[list[int]]
    seq_lens: list[int]
    query_lens: list[int]
    block_size: int
    null_block: int
    device: torch.device | str = "cpu"
    num_splits: int | None = None  # triton split-K parts (fixed for CUDA graphs)
    decode_rows: list[bool] | None = None  # which rows decode (default: the rows of one token)
    # Several KV groups (core/kv_spec.py): block ids per logical block in a table row (the
    # tables are flat rows: column c of logical block i at [i * width + c]), and each model
    # layer's column; 1 / None: one group.
    width: int = 1
    layer_columns: tuple[int, ...] | None = None


class AttentionBackend:
    """Paged attention for one device family: builds each step's metadata and runs every
    attention layer of the step over it. Subclasses: `torch_ref.TorchAttentionBackend`,
    `triton_attn.TritonAttentionBackend`."""

    name = ""
    supports_graphs = False  # its metadata is all tensors (no host-side groups): CUDA graphs

    def __init__(self, ops=None) -> None:
        self.ops = ops

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def build_metadata(self, batch: AttentionBatch) -> AttentionMetadata:
        """The step's metadata (`AttentionMetadata.build` for this backend), remembering its
        backend (`meta.impl`). With several KV groups (`batch.width > 1`) one metadata per
        column (its block tables and slots), the first's `per_layer` naming each layer's."""
        w = batch.width
        if w == 1:
            return self._build(batch, batch.block_tables)
        metas = [self._build(batch, [t[c::w] for t in batch.block_tables]) for c in range(w)]
        meta = metas[0]
        meta.per_layer = [metas[c] for c in batch.layer_columns]
        return meta

    def _build(self, batch: AttentionBatch, block_tables: list[list[int]]) -> AttentionMetadata:
        meta = AttentionMetadata.build(
            block_tables=block_tables, seq_lens=batch.seq_lens, query_lens=batch.query_lens,
            block_size=batch.block_size, null_block=batch.null_block, device=batch.device,
            backend=self.name, num_splits=batch.num_splits, decode_rows=batch.decode_rows)
        meta.impl = self
        return meta

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:  # [T, Hq, D]
        """Write the new K/V at their slots, attend every query over its context."""
        raise NotImplementedError

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        raise NotImplementedError

    def copy_blocks(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    src: torch.Tensor, dst: torch.Tensor) -> None:
        raise NotImplementedError


def backend_of(meta: AttentionMetadata) -> AttentionBackend:
    """The backend that runs `meta`: the one that built it, or (metadata built directly with
    `AttentionMetadata.build(backend=name)`) a default instance of that name."""
    impl = meta.impl
    if impl is None:
        from pagedserve.attention.backends import make_backend

        impl = meta.impl = make_backend(meta.backend)
    return impl
