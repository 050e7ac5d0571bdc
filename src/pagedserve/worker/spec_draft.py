"""Speculative decoding with a draft model, the worker's side of the "draft_model" proposer
(core/proposers/draft_model.py plans the slots): a small model sharing the target's
tokenizer proposes each speculative row's draft tokens (greedy, autoregressively) over its own
paged KV cache, just before the target verifies the row (worker/spec_verify.py).

The draft's KV cache has the target's block layout: as many blocks, of the same size, indexed by
the same block tables (its own tensors, `KVCache` of the draft's spec). So every block decision
the scheduler makes holds for the draft as well: a block freed with its request, swapped out and
in, copied on write, or found in the prefix cache carries the draft's K/V along with the target's.

NOTE (the invariant): the draft's cache holds exactly the positions the target's does. Every
step, the draft runs every row's real tokens (prefill chunks included: one forward over the
step's rows, as the target's), and for a speculative row of d drafts, d one-token forwards: the
real last token's logits give draft 1, draft j's forward gives draft j + 1, and draft d's forward
only writes its K/V. The draft has then written every position of the row, as the target does;
the step update truncates both caches to the accepted tokens alike (`KVCacheManager.truncate`).

The proposals are the draft's raw argmax (a point mass q): the verifier's point-mass rule then
keeps the target's distribution exactly, and seeded outputs are those without speculation.
"""

from __future__ import annotations

import time

import torch

from pagedserve.attention.backends.base import AttentionBackend, AttentionBatch
from pagedserve.core.proposers import DRAFT_SLOT
from pagedserve.core.step_input import StepInput, StepRow
from pagedserve.worker.kv_cache import KVCache


def wants_draft(row: StepRow) -> bool:
    """The row's draft tokens are slots for the draft model to fill (`DRAFT_SLOT`)."""
    spec = row.spec_token_ids
    return bool(spec) and spec[0] == DRAFT_SLOT


class DraftProposer:
    """The draft model of one worker over its own KV cache (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, attention: AttentionBackend,
                 device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attention = attention
        self.device = device
        self.seconds = 0.0  # time spent in the draft model, cumulative

    # --- the block operations, mirrored from the target's cache --------------------------------

    def apply_block_ops(self, step: StepInput) -> None:
        """Swap out, swap in and copy the draft's blocks as the target's (same order)."""
        self.kv_cache.apply_block_ops(step.blocks_to_swap_out, step.blocks_to_swap_in, step.blocks_to_copy)

    # --- the forward passes ----------------------------------------------------------------

    def _forward(self, ids: list[int], positions: list[int], tables: list[list[int]],
                 seq_lens: list[int], query_lens: list[int]) -> torch.Tensor:
        cache = self.kv_cache
        meta = self.attention.build_metadata(AttentionBatch(
            block_tables=tables, seq_lens=seq_lens, query_lens=query_lens,
            block_size=cache.block_size, null_block=cache.null_block, device=self.device))
        return self.model(torch.tensor(ids, dtype=torch.long, device=self.device),
                          torch.tensor(positions, dtype=torch.long, device=self.device),
                          cache.layers, meta)  # [T, H]

    def _argmax(self, hidden: torch.Tensor, rows: list[int]) -> list[int]:
        picked = hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))
        tokens = self.model.greedy_tokens(picked)  # [R] int64, or None
        if tokens is None:
            tokens = self.model.compute_logits(picked).float().argmax(dim=-1)
        return [int(t) for t in tokens.tolist()]

    @torch.inference_mode()
    def propose(self, step: StepInput) -> None:
        """Run the draft over the step (see the module docstring) and replace every speculative
        row's `DRAFT_SLOT`s with the draft's tokens (a new list: the row's own is not touched)."""
        if not step.rows:
            return
        started = time.perf_counter()
        ids: list[int] = []
        positions: list[int] = []
        ends: list[int] = []  # where each row's forward ends (its drafting slots excluded)
        last: list[int] = []  # flat index of each drafting row's last real token
        drafting: list[tuple[StepRow, int, int]] = []  # (row, drafts, real end)
        for row in step.rows:
            d = len(row.spec_token_ids)
            if d and wants_draft(row):
                end = row.end - d
                drafting.append((row, d, end))
                ids.extend(row.token_ids[row.start : end])
                last.append(len(ids) - 1)
            else:  # (drafts from elsewhere, the n-gram proposer's: the draft writes their K/V)
                end = row.end
                ids.extend(row.input_ids())
            positions.extend(range(row.start, end))
            ends.append(end)
        hidden = self._forward(ids, positions, [r.block_table for r in step.rows], ends,
                               [end - r.start for r, end in zip(step.rows, ends)])
        if not drafting:
            self.seconds += time.perf_counter() - started
            return
        drafts: list[list[int]] = [[t] for t in self._argmax(hidden, last)]
        for j in range(1, max(d for _, d, _ in drafting) + 1):
            # Draft j of every row that has one: its K/V, and (below the row's d) draft j + 1.
            active = [i for i, (_, d, _) in enumerate(drafting) if d >= j]
            rows = [drafting[i] for i in active]
            hidden = self._forward(
                [drafts[i][j - 1] for i in active], [end - 1 + j for _, _, end in rows],
                [row.block_table for row, _, _ in rows], [end + j for _, _, end in rows],
                [1] * len(rows))
            more = [n for n, (_, d, _) in enumerate(rows) if j < d]
            if more:
                for n, tok in zip(more, self._argmax(hidden, more)):
                    drafts[active[n]].append(tok)
        for (row, d, _), tokens in zip(drafting, drafts):
            row.spec_token_ids = tokens[:d]
        self.seconds += time.perf_counter() - started
