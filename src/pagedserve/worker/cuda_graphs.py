"""CUDA graphs for decode-only steps.

A decode step of a large model on a GPU is launch-bound at small batch: hundreds of small kernels
per token. `DecodeGraphs` captures the model's forward once per bucketed batch size (1, 2, 4, 8,
16, 24, 32, ... up to `max_num_seqs`) over persistent input buffers, and a decode-only step of `n`
sequences replays the graph of the smallest bucket >= n:

- the step's inputs are padded to the bucket (`pad_decode_batch`): padded rows read token 0 at
  position 0, with a block table of null blocks and a context of 1 token, and their slot is -1,
  which the Triton `write_kv` skips: they write nothing, and what they compute is never read;
- the attention metadata is built on the host for the padded batch, exactly as an eager step
  builds it (with the Triton backend: no host-side padded groups), and every tensor of it is
  copied into the captured metadata's tensors through pinned host buffers (asynchronously); the
  block tables are always padded to the width of `max_model_len`, so every shape is the
  bucket's;
- the graph writes the hidden states of all bucket rows; the runner computes logits eagerly on
  the rows of real sequences only.

The integers baked into the captured metadata (`num_tokens`, `max_seq_len`) are the bucket's and
`max_model_len`: kernels sized by them cover every real batch of that bucket.

Only the pure pieces (`graph_batch_sizes`, `pick_bucket`, `pad_decode_batch`) are tested on CPU;
`DecodeGraphs` takes a `capture` function so that its buffer handling can be exercised without a
GPU (tests pass an eager stand-in).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

logger = logging.getLogger(__name__)

# The slot of a padded row's new K/V: the Triton backend's `write_kv` skips negative slots.
PAD_SLOT = -1


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then every multiple of 8 below `max_num_seqs`, and
    `max_num_seqs` itself last (so that every decode batch the scheduler can form has a graph)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    sizes.append(max_num_seqs)
    return sizes


def pick_bucket(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n (sizes ascending), or None when n is above them all."""
    if n < 1:
        raise ValueError(f"a batch has at least one sequence, got {n}")
    for b in sizes:
        if b >= n:
            return b
    return None


@dataclass
class PaddedBatch:
    """Host inputs of one decode step padded to a bucket (one query token per row)."""

    input_ids: list[int]
    positions: list[int]
    block_tables: list[list[int]]  # every row `max_blocks` wide, padded with the null block
    seq_lens: list[int]
    query_lens: list[int]
    num_real: int


def pad_decode_batch(
    input_ids: list[int],
    positions: list[int],
    block_tables: list[list[int]],
    seq_lens: list[int],
    *,
    bucket: int,
    max_blocks: int,
    null_block: int,
) -> PaddedBatch:
    """Pad a decode-only batch (one token per sequence) to `bucket` rows and its block tables to
    `max_blocks` columns. Padded rows: token 0 at position 0, context of 1 token, all blocks null
    (they attend to the null block's first slot alone; the caller sets their slot to `PAD_SLOT`
    so that they write nothing)."""
    n = len(input_ids)
    if not (len(positions) == len(block_tables) == len(seq_lens) == n):
        raise ValueError("input_ids, positions, block_tables and seq_lens need one entry per row")
    if n > bucket:
        raise ValueError(f"{n} sequences do not fit a bucket of {bucket}")
    tables = []
    for t in block_tables:
        if len(t) > max_blocks:
            raise ValueError(f"a block table of {len(t)} blocks is wider than {max_blocks}")
        tables.append(list(t) + [null_block] * (max_blocks - len(t)))
    pad = bucket - n
    tables += [[null_block] * max_blocks for _ in range(pad)]
    return PaddedBatch(
        input_ids=list(input_ids) + [0] * pad,
        positions=list(positions) + [0] * pad,
        block_tables=tables,
        seq_lens=list(seq_lens) + [1] * pad,
        query_lens=[1] * bucket,
        num_real=n,
    )


def _tensor_fields(meta) -> dict[str, torch.Tensor]:
    return {f.name: getattr(meta, f.name) for f in fields(meta)
            if isinstance(getattr(meta, f.name), torch.Tensor)}


class _Staged:
    """A persistent tensor the graph reads, and a pinned host twin to fill it from."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        pin = target.device.type == "cuda"
        self.host = torch.empty(target.shape, dtype=target.dtype, pin_memory=pin)

    def load(self, value: torch.Tensor) -> None:
        if value.shape != self.target.shape or value.dtype != self.target.dtype:
            raise RuntimeError(f"CUDA graph input of shape {tuple(value.shape)} {value.dtype} "
                               f"does not match the captured {tuple(self.target.shape)} "
                               f"{self.target.dtype}")
        self.host.copy_(value)
        self.target.copy_(self.host, non_blocking=True)


@dataclass
class _Entry:
    graph: object  # torch.cuda.CUDAGraph, or a test stand-in with `replay()`
    inputs: list[_Staged]  # input_ids, positions, then every tensor of the metadata
    meta_names: list[str]
    hidden: torch.Tensor  # [bucket, H] written by the graph
    # Recorded after the last host-to-device copies: the pinned buffers are refilled only once
    # those copies are done (a rank that samples nothing never waits on the GPU otherwise).
    loaded: object = None


def capture_cuda_graph(fn: Callable[[], torch.Tensor], pool) -> tuple[object, torch.Tensor, object]:
    """Capture `fn()` (one forward over persistent buffers) into a CUDA graph sharing `pool`;
    returns (graph, its output tensor, the pool). `fn` must have run once eagerly before (Triton
    compiles and cuBLAS sets up outside the capture)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out, graph.pool() if pool is None else pool


class DecodeGraphs:
    """One captured forward per bucket; see the module docstring.

    `build_meta(block_tables, seq_lens, query_lens, device)` builds the attention metadata as the
    runner does for an eager step (it must not produce host-built padded groups);
    `forward(ids, positions, meta)` runs the model's forward to hidden states [T, H].
    """

    def __init__(
        self,
        *,
        forward: Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor],
        build_meta: Callable[..., object],
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        null_block: int,
        capture: Callable = capture_cuda_graph,
    ) -> None:
        self.forward = forward
        self.build_meta = build_meta
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.null_block = null_block
        self.max_blocks = -(-max_model_len // block_size)
        self._capture = capture
        self.entries: dict[int, _Entry] = {}
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def capture_all(self) -> None:
        """Capture every bucket, largest first (the later, smaller graphs reuse its memory pool)."""
        start = time.perf_counter()
        pool = None
        for b in reversed(self.sizes):
            pool = self._capture_bucket(b, pool)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s",
                    self.sizes, time.perf_counter() - start)

    def _capture_bucket(self, b: int, pool):
        # NOTE: captured with every context at max_model_len over null blocks: kernels sized by
        # the metadata's integers (max_seq_len) then cover any real batch of this bucket.
        tables = [[self.null_block] * self.max_blocks for _ in range(b)]
        meta = self.build_meta(block_tables=tables, seq_lens=[self.max_model_len] * b,
                               query_lens=[1] * b, device=self.device)
        meta.slot_mapping.fill_(PAD_SLOT)  # capture and warm-up write nothing
        ids = torch.zeros(b, dtype=torch.long, device=self.device)
        pos = torch.full((b,), self.max_model_len - 1, dtype=torch.long, device=self.device)
        tensors = _tensor_fields(meta)
        inputs = [_Staged(ids), _Staged(pos)] + [_Staged(t) for t in tensors.values()]
        self.forward(ids, pos, meta)  # warm-up: compile and set up outside the capture
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        graph, hidden, pool = self._capture(lambda: self.forward(ids, pos, meta), pool)
        self.entries[b] = _Entry(graph, inputs, list(tensors), hidden)
        return pool

    def can_run(self, num_seqs: int) -> bool:
        return bool(self.entries) and num_seqs <= self.max_batch

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        seq_lens: list[int],
    ) -> torch.Tensor:
        """Replay the graph of the batch's bucket; returns the hidden states of the real rows
        [n, H] (a view into the graph's output: use it before the next replay)."""
        b = pick_bucket(len(input_ids), self.sizes)
        entry = self.entries[b]
        padded = pad_decode_batch(input_ids, positions, block_tables, seq_lens, bucket=b,
                                  max_blocks=self.max_blocks, null_block=self.null_block)
        fresh = self.build_meta(block_tables=padded.block_tables, seq_lens=padded.seq_lens,
                                query_lens=padded.query_lens, device="cpu")
        fresh.slot_mapping[padded.num_real:] = PAD_SLOT
        fresh_tensors = _tensor_fields(fresh)
        values = [torch.tensor(padded.input_ids, dtype=torch.long),
                  torch.tensor(padded.positions, dtype=torch.long)]
        values += [fresh_tensors[name] for name in entry.meta_names]
        if entry.loaded is not None:
            entry.loaded.synchronize()
        for staged, value in zip(entry.inputs, values):
            staged.load(value)
        if self.device.type == "cuda":
            entry.loaded = torch.cuda.Event()
            entry.loaded.record()
        entry.graph.replay()
        self.replays += 1
        return entry.hidden[: padded.num_real]
