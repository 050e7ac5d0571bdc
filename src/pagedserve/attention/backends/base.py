"""The interface of an attention backend and the batch its metadata is built from."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from pagedserve.attention.metadata import AttentionMetadata


@dataclass
class AttentionBatch:
    """One step's sequences as host lists, in flat-batch order (see `AttentionMetadata.build`):
    block tables, context lengths after the step, query lengths; the cache's geometry; what a
    backend's own metadata takes from the step (`num_splits`, the Triton backend's)."""

    block_tables: list[list[int]]
    seq_lens: list[int]
    query_lens: list[int]
    block_size: int
    null_block: int
    device: torch.device | str = "cpu"
    num_splits: int | None = None  # Triton split-K parts (fixed for CUDA graphs); others ignore it
    decode_rows: list[bool] | None = None  # which rows decode (default: the rows of one token)
    # Several KV groups (core/kv_spec.py): block ids per logical block in a table row (the
    # tables are flat rows: column c of logical block i at [i * width + c]), and each model
    # layer's column; 1 / None: one group.
    width: int = 1
    layer_columns: tuple[int, ...] | None = None
    # The sliding window of each column (None: full attention), or None: no column slides.
    column_windows: tuple[int | None, ...] | None = None
    # The columns of recurrent state groups: their layers read only each sequence's first
    # logical block (`layers.recurrent_state`), so their metadata is a cheap copy of another
    # column's with those blocks as its tables.
    state_columns: tuple[int, ...] = ()


class AttentionBackend:
    """Paged attention for one device family: builds each step's metadata (its own subclass of
    `AttentionMetadata`, `metadata_class`) and runs every attention layer of the step over it.
    Subclasses: `torch_ref.TorchAttentionBackend`, `triton_attn.TritonAttentionBackend`."""

    name = ""
    metadata_class: type[AttentionMetadata] = AttentionMetadata  # what `build_metadata` builds
    supports_graphs = False  # its metadata is all tensors (no host-side groups): CUDA graphs

    def __init__(self, ops=None) -> None:
        self.ops = ops

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def build_metadata(self, batch: AttentionBatch) -> AttentionMetadata:
        """The step's metadata, a `metadata_class` (`AttentionMetadata.build`), remembering its
        backend (`meta.impl`: this one). With several KV groups (`batch.width > 1`) one metadata per
        column (its block tables and slots), the first's `per_layer` naming each layer's."""
        w, windows = batch.width, batch.column_windows
        if w == 1 and not (windows and windows[0]):
            return self._build(batch, batch.block_tables, batch.seq_lens)
        metas = []
        state = set(batch.state_columns)
        for c in range(w):
            if c in state and metas:
                metas.append(None)  # (below)
                continue
            window = windows[c] if windows else None
            if window:
                tables, seq_lens = window_tail(batch.block_tables, w, c, batch.seq_lens,
                                               batch.query_lens, batch.block_size, window)
            else:
                tables = [t[c::w] for t in batch.block_tables] if w > 1 else batch.block_tables
                seq_lens = batch.seq_lens
            metas.append(self._build(batch, tables, seq_lens))
        if state and None in metas:
            base = metas[0]
            firsts = torch.tensor([[t[c] for c in range(w)] for t in batch.block_tables],
                                  dtype=torch.int64, device=base.block_tables.device)  # [S, W]
            for c, m in enumerate(metas):
                if m is None:
                    metas[c] = copy.copy(base)
                    metas[c].block_tables = firsts[:, c : c + 1]  # [S, 1]
                    metas[c]._token_rows = None
                    # every state column's first blocks, shared: a layer of several entries
                    # takes its block ids in one index (`PagedState.block_ids`)
                    metas[c].state_firsts, metas[c].state_column = firsts, c
        meta = metas[0]
        if w > 1:
            meta.per_layer = [metas[c] for c in batch.layer_columns]
        return meta

    def _build(self, batch: AttentionBatch, block_tables: list[list[int]],
               seq_lens: list[int]) -> AttentionMetadata:
        """One column's metadata (`build_metadata`); a backend whose metadata takes more of the
        batch than its tables sets it here."""
        return self.metadata_class.build(
            impl=self, block_tables=block_tables, seq_lens=seq_lens, query_lens=batch.query_lens,
            block_size=batch.block_size, null_block=batch.null_block, device=batch.device,
            decode_rows=batch.decode_rows)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None, *,
                sinks: torch.Tensor | None = None) -> torch.Tensor:  # [T, Hq, D]
        """Write the new K/V at their slots, attend every query over its context (`softcap`:
        scaled scores s capped as `softcap * tanh(s / softcap)` before the softmax; `sinks`
        ([Hq] learned logits, gpt-oss): one more term per head in each softmax's denominator)."""
        raise NotImplementedError

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        raise NotImplementedError

    def copy_blocks(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    src: torch.Tensor, dst: torch.Tensor) -> None:
        raise NotImplementedError


# The prompt kernels' key tiles (csrc/prefill_attention.cpp): a context is only ever shifted by
# a multiple of this many positions (window_tail).
KEY_TILE = 32


def window_tail(block_tables: list[list[int]], width: int, column: int, seq_lens: list[int],
                query_lens: list[int], block_size: int, window: int):
    """A sliding-window column's tables and context lengths as its attention sees them: each
    row from the first logical block its first query's window reaches, positions shifted by
    the blocks cut (attention depends on key order and distance only: the same keys in the
    same order, the same bits). The column's blocks before that were given back (null) and
    are not passed at all, so a long sequence's window column costs its window, not its length.

    NOTE: the shift is a multiple of KEY_TILE positions (a few given-back blocks more, null
    entries no query reaches): the prefill kernels group keys by their position in the sequence
    (pairs on AVX512-BF16, tiles of 32 on AMX, kernels/cpu_attention.py), and a shift by whole
    groups keeps the bits of every chunking the same."""
    step = KEY_TILE // math.gcd(block_size, KEY_TILE)  # blocks per shift unit
    tables, lens = [], []
    for t, n, q in zip(block_tables, seq_lens, query_lens):
        first = max(0, n - q - window + 1) // block_size
        first -= first % step
        tables.append(t[column + first * width :: width])
        lens.append(n - first * block_size)
    return tables, lens

