"""The model runner: owns the model and the KV cache tensors, turns a scheduled step into one flat
batch, runs the model and samples. It knows nothing of queues or preemption."""

from __future__ import annotations

import functools
import gc
import importlib.util
import inspect
import logging
from dataclasses import dataclass

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.kernels.cpu_gemm import kernel_available
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.kv_cache import KVCache
from pagedserve.worker.sampler import (
    SampleRequest,
    SampleResult,
    logprob_stats,
    needs_processing,
    prompt_logprobs,
    sample,
)

logger = logging.getLogger(__name__)


@functools.cache
def _metadata_takes_backend() -> bool:
    return "backend" in inspect.signature(AttentionMetadata.build).parameters


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The attention backend a runner on `device` uses for `name` ("auto" | "torch" | "triton"):
    "auto" is Triton on CUDA when Triton and our Triton backend are importable, else the torch
    reference (always on CPU)."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")
    if name != "auto":
        if name == "triton" and not _metadata_takes_backend():
            raise ValueError("attention_backend='triton' is not available in this build")
        return name
    if torch.device(device).type != "cuda" or not _metadata_takes_backend():
        return "torch"
    return "triton" if importlib.util.find_spec("triton") is not None else "torch"


def build_metadata(backend: str, **kwargs) -> AttentionMetadata:
    """`AttentionMetadata.build(**kwargs)` for `backend` (the torch reference's is the default)."""
    if backend != "torch":
        kwargs["backend"] = backend
    return AttentionMetadata.build(**kwargs)


def is_plain_greedy(params: SamplingParams, num_output_tokens: int, need_logprob: bool) -> bool:
    """A row whose token is the argmax of the raw logits, nothing else asked (no logprobs, no
    logit processors): it can be chosen without the host sampler (one integer per row)."""
    return (params.temperature < 1e-5 and params.logprobs is None and not need_logprob
            and not needs_processing(params, num_output_tokens))


def plain_greedy_rows(step: SchedulerOutput, row_owner: list[tuple[int, str]]) -> list[int] | None:
    """The scheduled index of each logits row when every row samples one plain-greedy token (see
    `is_plain_greedy`; no prompt logprobs, beams or forking groups); None otherwise."""
    owners = []
    for idx, kind in row_owner:
        s = step.scheduled[idx]
        group = s.group
        if kind != "sample" or group.beam is not None or s.num_samples > 1:
            return None
        if not is_plain_greedy(group.sampling_params, len(s.seq.output_token_ids),
                               group.needs_logprobs):
            return None
        owners.append(idx)
    return owners


@dataclass(frozen=True)
class MemoryProfile:
    """One GPU worker's profile: the device's total memory and the peak a forward pass at the
    largest batch reached (weights + activations + logits + memory outside torch's allocator)."""

    total: int
    peak: int


def profile_seq_lens(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the profiling batch: `max_num_batched_tokens` tokens (at most
    `max_num_seqs * max_model_len`) over as many sequences as allowed, as even as possible."""
    tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    n = min(max_num_seqs, tokens)
    n = max(n, -(-tokens // max_model_len))
    base, extra = divmod(tokens, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def profile_forward(model, kv_cache: KVCache, *, device: torch.device, backend: str,
                    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
    """Run the largest step the scheduler can form: a prefill of `max_num_batched_tokens`
    tokens, then logits for `max_num_seqs` rows, in float32 as the sampler takes them. Every block
    table points at block 0 of `kv_cache` (a scratch cache: the writes collide, harmlessly).
    Returns the number of tokens run."""
    lens = profile_seq_lens(max_num_batched_tokens, max_num_seqs, max_model_len)
    bs = kv_cache.block_size
    meta = build_metadata(backend, block_tables=[[0] * -(-n // bs) for n in lens], seq_lens=lens,
                          query_lens=lens, block_size=bs, null_block=kv_cache.null_block,
                          device=device)
    total = sum(lens)
    ids = torch.zeros(total, dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(n, dtype=torch.long) for n in lens]).to(device)
    hidden = model(ids, pos, kv_cache.layers, meta)  # [T, H]
    rows = torch.arange(max_num_seqs, device=device) % total
    logits = model.compute_logits(hidden.index_select(0, rows)).float()  # [S, V]
    logits.argmax(dim=-1)
    del hidden, logits
    return total


@torch.inference_mode()
def profile_peak_memory(model, spec, *, dtype: torch.dtype, device: torch.device, block_size: int,
                        backend: str, max_num_batched_tokens: int, max_num_seqs: int,
                        max_model_len: int) -> MemoryProfile:
    """Profile the peak GPU memory of the largest step (see `profile_forward`) on `device`."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    scratch = KVCache(spec, 1, block_size, dtype, device)
    profile_forward(model, scratch, device=device, backend=backend,
                    max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                    max_model_len=max_model_len)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    # Memory outside torch's allocator (CUDA context, cuBLAS/NCCL buffers, other processes).
    outside = max(0, (total - free) - torch.cuda.memory_reserved(device))
    del scratch
    gc.collect()
    torch.cuda.empty_cache()
    logger.info("memory profile on %s: peak %.2f GiB in torch + %.2f GiB outside it, of %.2f GiB",
                device, peak / 2**30, outside / 2**30, total / 2**30)
    return MemoryProfile(total=int(total), peak=int(peak + outside))


@dataclass
class SeqStepOutput:
    """What one scheduled sequence got from this step."""

    seq_id: int
    # One result per sequence this row samples for: empty when the step did not reach the
    # sequence's end; `num_samples` results when the group forks after its shared prefill.
    samples: list[SampleResult]
    # (logprob, rank, top-k) for each prompt position start+1 .. end of this chunk, if asked
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None
    # Beam search: the row's best 2 * beam_width (token, raw logprob), best first.
    beam_candidates: list[tuple[int, float]] | None = None


class ModelRunner:
    """Runs steps of a model over a paged KV cache.

    NOTE: per-request random generators live here, keyed by request id, and survive preemption;
    they are dropped only when the scheduler reports the request finished.

    Under tensor parallelism every rank runs one, on its shard; only rank 0's samples
    (`sample=True`): the others run the same forward (and logits gather) and return [].
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        *,
        device: torch.device,
        stop_token_ids_for_min_tokens: list[int],
        sample: bool = True,
        attention_backend: str = "auto",
        cuda_graphs: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
    ) -> None:
        self.model = model
        self.sample = sample
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.eos_ids = list(stop_token_ids_for_min_tokens)
        self.generators: dict[str, torch.Generator] = {}
        self.attention_backend = resolve_attention_backend(attention_backend, self.device)
        self.on_cuda = self.device.type == "cuda"
        # Pinned host buffers for what comes back each step (CUDA only), grown on demand.
        self._host_logits: torch.Tensor | None = None
        self._host_tokens: torch.Tensor | None = None
        # NOTE: build (or load) the compiled CPU kernels now rather than in the first request's
        # step: a fresh machine compiles them once (about a minute), and the host-side sampler
        # uses them whatever the device or dtype (warns once and falls back where unavailable).
        kernel_available()
        self.graphs = None
        if cuda_graphs and self.on_cuda:
            if self.attention_backend == "torch":
                logger.info("CUDA graphs off: the torch attention backend builds per-step "
                            "host-side groups (use attention_backend='triton')")
            else:
                self.capture_graphs(max_num_seqs, max_model_len)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, capture=None) -> None:
        """Capture the decode graphs (after the KV cache is allocated); see `worker.cuda_graphs`.
        `capture` replaces the CUDA graph capture (tests run the buffer logic on CPU)."""
        from pagedserve.worker.cuda_graphs import DecodeGraphs, capture_cuda_graph

        layers = self.kv_cache.layers
        graphs = DecodeGraphs(
            forward=lambda ids, pos, meta: self.model(ids, pos, layers, meta),
            build_meta=self._build_meta, device=self.device, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, block_size=self.kv_cache.block_size,
            null_block=self.kv_cache.null_block, capture=capture or capture_cuda_graph)
        with torch.inference_mode():
            graphs.capture_all()
            # Capture and warm-up wrote into the null block: it is zero again before any step.
            for k, v in layers:
                k[self.kv_cache.null_block].zero_()
                v[self.kv_cache.null_block].zero_()
        self.graphs = graphs

    def _build_meta(self, *, block_tables, seq_lens, query_lens, device) -> AttentionMetadata:
        return build_metadata(self.attention_backend, block_tables=block_tables,
                              seq_lens=seq_lens, query_lens=query_lens,
                              block_size=self.kv_cache.block_size,
                              null_block=self.kv_cache.null_block, device=device)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
            self.generators[request_id] = gen
        return gen

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> list[SeqStepOutput]:
        """Run one step; return one entry per scheduled sequence, in scheduled order."""
        for request_id in step.finished_request_ids:
            self.generators.pop(request_id, None)
        # NOTE: this order matters; see SchedulerOutput.
        if step.blocks_to_swap_out:
            self.kv_cache.swap_out(step.blocks_to_swap_out)
        if step.blocks_to_swap_in:
            self.kv_cache.swap_in(step.blocks_to_swap_in)
        if step.blocks_to_copy:
            self.kv_cache.copy_blocks(step.blocks_to_copy)
        if not step.scheduled:
            return []

        input_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        row_owner: list[tuple[int, str]] = []  # (scheduled index, "sample" | "prompt")
        offset = 0
        for idx, s in enumerate(step.scheduled):
            input_ids.extend(s.seq.token_ids[s.start : s.end])
            positions.extend(range(s.start, s.end))
            if s.wants_prompt_logprobs:
                logit_rows.extend(range(offset, offset + s.num_tokens))
                row_owner.extend([(idx, "prompt")] * s.num_tokens)
            elif s.do_sample:
                logit_rows.append(offset + s.num_tokens - 1)
                row_owner.append((idx, "sample"))
            offset += s.num_tokens

        block_tables = [s.block_table for s in step.scheduled]
        seq_lens = [s.end for s in step.scheduled]
        if (self.graphs is not None and offset == len(step.scheduled)
                and self.graphs.can_run(offset)):
            # Decode-only (one token per sequence): replay the bucket's CUDA graph.
            hidden = self.graphs.run(input_ids, positions, block_tables, seq_lens)  # [n, H]
        else:
            meta = self._build_meta(block_tables=block_tables, seq_lens=seq_lens,
                                    query_lens=[s.num_tokens for s in step.scheduled],
                                    device=self.device)
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)  # [T]
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
            hidden = self.model(ids, pos, self.kv_cache.layers, meta)  # [T, H]
        if logit_rows == list(range(offset)):  # decode-only: every row, in order
            hidden_rows = hidden  # [R, H]
        else:
            rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
            hidden_rows = hidden.index_select(0, rows)  # [R, H]
        greedy = plain_greedy_rows(step, row_owner)
        if greedy == []:  # nothing to sample (prompt chunks short of their end): no LM head
            return self._greedy_outputs(step, [], torch.empty(0)) if self.sample else []
        if greedy is not None and not self.on_cuda:
            # NOTE: decided from the step alone, so every tensor-parallel rank takes the same
            # branch (a model that gathers logits returns None on every rank).
            tokens = self.model.greedy_tokens(hidden_rows)  # [R] int64, or None
            if tokens is not None:
                return self._greedy_outputs(step, greedy, tokens) if self.sample else []
        logits = self.model.compute_logits(hidden_rows)  # [R, V]
        if not self.sample:
            return []
        if self.on_cuda:
            if greedy is not None:
                return self._greedy_on_device(step, greedy, logits)
            logits = self._to_host(logits)  # [R, V] float32, pinned
        else:
            logits = logits.float().cpu()  # [R, V]

        outputs = [SeqStepOutput(s.seq.seq_id, []) for s in step.scheduled]
        sample_rows, sample_idx = [], []
        r = 0
        while r < len(row_owner):
            idx, kind = row_owner[r]
            s = step.scheduled[idx]
            if kind == "sample":
                sample_rows.append(r)
                sample_idx.append(idx)
                r += 1
                continue
            # Prompt logprobs for this chunk: row p predicts token p + 1 (prompt tokens only).
            n = s.num_tokens
            last_prompt = min(s.end, s.seq.num_prompt_tokens - 1)
            k = s.group.sampling_params.prompt_logprobs or 0
            m = max(0, last_prompt - s.start)
            targets = s.seq.token_ids[s.start + 1 : s.start + 1 + m]
            outputs[idx].prompt_logprobs = (
                prompt_logprobs(logits[r : r + m], targets, k) if m else []
            )
            if s.do_sample:
                sample_rows.append(r + n - 1)
                sample_idx.append(idx)
            r += n

        if sample_rows:
            rows, reqs, owners = [], [], []
            for row, idx in zip(sample_rows, sample_idx):
                s = step.scheduled[idx]
                if s.group.beam is not None:  # the row's best 2 * beam_width raw logprobs
                    [(_, _, top)] = logprob_stats(logits[row : row + 1], [0],
                                                  2 * s.group.beam.params.beam_width)
                    outputs[idx].beam_candidates = top
                    continue
                params = s.group.sampling_params
                gen = self._generator(s.group.request_id, params.seed)
                grammar = step.grammar_bitmask
                # NOTE: a forking group draws all its first tokens from the parent's row, in
                # sequence order, from the one request generator: distinct and reproducible.
                for seq in s.group.seqs[: s.num_samples] if s.num_samples > 1 else [s.seq]:
                    rows.append(row)
                    owners.append(idx)
                    reqs.append(SampleRequest(
                        params=params,
                        prompt_token_ids=seq.prompt_token_ids,
                        output_token_ids=seq.output_token_ids,
                        generator=gen,
                        need_logprob=s.group.needs_logprobs,
                        token_bitmask=(grammar.bitmask[grammar.rows[seq.seq_id]]
                                       if grammar is not None and seq.seq_id in grammar.rows
                                       else None),
                    ))
            stop_ids = [
                ([] if r_.params.ignore_eos else self.eos_ids) + list(r_.params.stop_token_ids or [])
                for r_ in reqs
            ]
            # (the usual decode step samples every row once, in order: no 16 MB gather then)
            picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
            results = sample(picked, reqs, stop_ids) if rows else []
            for idx, res in zip(owners, results):
                outputs[idx].samples.append(res)
        return outputs

    # --- CUDA: what comes back to the host --------------------------------------------------

    def _to_host(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits as float32 on the host, through a pinned buffer (one sync: the sampler
        needs them)."""
        r, v = logits.shape
        buf = self._host_logits
        if buf is None or buf.shape[0] < r or buf.shape[1] != v:
            buf = self._host_logits = torch.empty((max(r, 1), v), dtype=torch.float32,
                                                  pin_memory=True)
        out = buf[:r]
        out.copy_(logits, non_blocking=True)  # casts to float32 on the way
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def _greedy_on_device(self, step: SchedulerOutput, owners: list[int],
                          logits: torch.Tensor) -> list[SeqStepOutput]:
        """Every row samples plain greedy (`plain_greedy_rows`): choose the tokens on the GPU and
        bring back one integer per row instead of the logits."""
        r = logits.shape[0]
        buf = self._host_tokens
        if buf is None or buf.shape[0] < r:
            buf = self._host_tokens = torch.empty(max(r, 256), dtype=torch.long, pin_memory=True)
        tokens = buf[:r]
        # NOTE: argmax of the float32 logits, as the host sampler takes them (same tie rule).
        tokens.copy_(logits.float().argmax(dim=-1), non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return self._greedy_outputs(step, owners, tokens)

    @staticmethod
    def _greedy_outputs(step: SchedulerOutput, owners: list[int],
                        tokens: torch.Tensor) -> list[SeqStepOutput]:
        """One plain-greedy sample per row: row i's token goes to scheduled index owners[i]."""
        outputs = [SeqStepOutput(s.seq.seq_id, []) for s in step.scheduled]
        for idx, tok in zip(owners, tokens.tolist()):
            outputs[idx].samples.append(SampleResult(tok, None, None, None))
        return outputs
