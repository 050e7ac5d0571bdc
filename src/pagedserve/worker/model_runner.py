"""The model runner: owns the model and the KV cache tensors, turns a scheduled step into one flat
batch, runs the model and samples. It knows nothing of queues or preemption."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedserve.attention.backends.base import AttentionBackend, AttentionBatch
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.step_input import StepInput
from pagedserve.core.step_output import SampleResult, SeqStepOutput
from pagedserve.platforms import Platform, platform_for
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.kv_cache import KVCache
from pagedserve.worker.pooler import Pooler
from pagedserve.worker.spec_draft import wants_draft
from pagedserve.worker.spec_verify import accept_greedy, verify_row
from pagedserve.worker.sampler import (
    SampleRequest,
    logprob_stats,
    needs_processing,
    prompt_logprobs,
    sample,
)

logger = logging.getLogger(__name__)


def is_plain_greedy(params: SamplingParams, num_output_tokens: int, need_logprob: bool) -> bool:
    """A row whose token is the argmax of the raw logits, nothing else asked (no logprobs, no
    logit processors): it can be chosen without the host sampler (one integer per row)."""
    return (params.temperature < 1e-5 and params.logprobs is None and not need_logprob
            and not needs_processing(params, num_output_tokens))


def plain_greedy_rows(step: StepInput, row_owner: list[tuple[int, str]]) -> list[int] | None:
    """The row index of each logits row when every row samples one plain-greedy token (see
    `is_plain_greedy`; no prompt logprobs, beams or forking groups); None otherwise."""
    owners = []
    for idx, kind in row_owner:
        row = step.rows[idx]
        if kind == "prompt" or row.beam_width or len(row.samples) != 1:
            return None
        if not is_plain_greedy(row.params, row.num_output_tokens, row.need_logprob):
            return None
        owners.append(idx)
    return owners


def accept_plain_greedy(step: StepInput, outputs: list[SeqStepOutput]) -> list[SeqStepOutput]:
    """Plain-greedy outputs (one argmax per logits row) with every speculative row cut to what
    it emits: its accepted drafts and the token after them (worker/spec_verify.py)."""
    for row, out in zip(step.rows, outputs):
        if row.spec_token_ids and out.samples:
            del out.samples[accept_greedy([r.token_id for r in out.samples],
                                          row.spec_token_ids):]
    return outputs


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


def profile_forward(model, kv_cache: KVCache, *, device: torch.device, backend: AttentionBackend,
                    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
    """Run the largest step the scheduler can form: a prefill of `max_num_batched_tokens`
    tokens, then logits for `max_num_seqs` rows, in float32 as the sampler takes them. Every block
    table points at block 0 of `kv_cache` (a scratch cache: the writes collide, harmlessly).
    Returns the number of tokens run."""
    lens = profile_seq_lens(max_num_batched_tokens, max_num_seqs, max_model_len)
    bs = kv_cache.block_size
    meta = backend.build_metadata(AttentionBatch(
        block_tables=[[0] * -(-n // bs) for n in lens], seq_lens=lens, query_lens=lens,
        block_size=bs, null_block=kv_cache.null_block, device=device))
    total = sum(lens)
    ids = torch.zeros(total, dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(n, dtype=torch.long) for n in lens]).to(device)
    hidden = model(ids, pos, kv_cache.layers, meta)  # [T, H]
    rows = torch.arange(max_num_seqs, device=device) % total
    logits = model.compute_logits(hidden.index_select(0, rows)).float()  # [S, V]
    logits.argmax(dim=-1)
    del hidden, logits
    return total


class ModelRunner:
    """Runs steps of a model over a paged KV cache.

    NOTE: the random generators of seeded requests live here, one per sequence (keyed by request
    id and sample index), and survive preemption; they are dropped only when the scheduler
    reports the request finished.

    Under tensor parallelism every rank runs one, on its shard; only rank 0's samples
    (`sample=True`): the others run the same forward (and logits gather) and return [].

    The device's choices come from `platform` (None: `platform_for(device)`): the attention
    backend (`attention_backend` resolved once into an `AttentionBackend`, which builds each
    step's metadata), whether decode steps replay CUDA graphs, pinned buffers.
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
        platform: Platform | None = None,
        lora=None,
        drafter=None,
    ) -> None:
        self.model = model
        # speculative decoding's draft model (worker.spec_draft.DraftProposer), else None
        self.drafter = drafter
        self.lora = lora  # lora.slots.LoRASlots (enable_lora), else None
        self.sample = sample
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.eos_ids = list(stop_token_ids_for_min_tokens)
        self.generators: dict[str, dict[int, torch.Generator]] = {}
        self.pooler = Pooler()  # pooling requests' partial states (runner="pooling")
        self.platform = platform or platform_for(self.device)
        self.attention = self.platform.attention_backend(attention_backend)
        self.attention_backend = self.attention.name  # "torch" | "triton"
        # Off the host (CUDA), tokens and logits come back through pinned buffers, grown on demand.
        self.off_host = not self.platform.is_host
        self._host_logits: torch.Tensor | None = None
        self._host_tokens: torch.Tensor | None = None
        self.platform.warm_up_host_kernels(sample)
        self.graphs = None
        # NOTE: the graphs hold one set of block tables: a model of several KV groups runs eager.
        if (cuda_graphs and kv_cache.width == 1
                and self.platform.use_cuda_graphs(False, self.attention)):
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
            for pair in self.kv_cache.slots:
                for t in pair:
                    if t is not None:
                        t[self.kv_cache.null_block].zero_()
        self.graphs = graphs

    def _build_meta(self, *, block_tables, seq_lens, query_lens, device,
                    num_splits: int | None = None, decode_rows=None) -> AttentionMetadata:
        kv = self.kv_cache
        return self.attention.build_metadata(AttentionBatch(
            block_tables=block_tables, seq_lens=seq_lens, query_lens=query_lens,
            block_size=kv.block_size, null_block=kv.null_block,
            device=device, num_splits=num_splits, decode_rows=decode_rows,
            width=kv.width, layer_columns=kv.layout.layer_column if kv.width > 1 else None,
            column_windows=kv.column_windows, state_columns=kv.state_columns))

    def _generator(self, request_id: str, seed: int | None, index: int) -> torch.Generator | None:
        """The random stream of sample `index` of a seeded request.

        NOTE: one stream per sequence (seeded with `seed` for the first, and a value derived
        from `seed` and `index` for the others), so that a sequence's draws do not depend on
        which of its siblings are computed in the same step (a group may compute a subset of
        its sequences in a step, e.g. while it is recomputed).
        """
        if seed is None:
            return None
        streams = self.generators.setdefault(request_id, {})
        gen = streams.get(index)
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed if index == 0 else hash((seed, index)) & (2**63 - 1))
            streams[index] = gen
        return gen

    @torch.inference_mode()
    def execute(self, step: StepInput) -> list[SeqStepOutput]:
        """Run one step; return one entry per row, in order."""
        for request_id in step.finished_request_ids:
            self.generators.pop(request_id, None)
        self.pooler.drop(step.finished_request_ids)
        # NOTE: this order matters; see SchedulerOutput.
        self.kv_cache.apply_block_ops(step.blocks_to_swap_out, step.blocks_to_swap_in, step.blocks_to_copy)
        if self.drafter is not None:
            # NOTE: the draft's cache follows the target's block for block (worker/spec_draft.py),
            # and its proposals fill the rows' draft slots before the target reads them.
            self.drafter.apply_block_ops(step)
            self.drafter.propose(step)
        elif any(wants_draft(s) for s in step.rows if s.spec_token_ids):
            raise RuntimeError("a step has draft-model slots but this worker has no draft model")
        if not step.rows:
            return []

        input_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        row_owner: list[tuple[int, str]] = []  # (scheduled index, "sample" | "prompt")
        starts: list[int] = []  # each row's first position in the flat batch
        offset = 0
        for idx, s in enumerate(step.rows):
            input_ids.extend(s.input_ids() if s.spec_token_ids else s.token_ids[s.start : s.end])
            positions.extend(range(s.start, s.end))
            starts.append(offset)
            if s.pooling is not None:
                pass  # pooled from the hidden states (worker/pooler.py): no logits
            elif s.prompt_logprobs:
                logit_rows.extend(range(offset, offset + s.num_tokens))
                row_owner.extend([(idx, "prompt")] * s.num_tokens)
            elif s.spec_token_ids:  # speculative: the last real token's and every draft's
                n = len(s.spec_token_ids) + 1
                logit_rows.extend(range(offset + s.num_tokens - n, offset + s.num_tokens))
                row_owner.extend([(idx, "spec")] * n)
            elif s.do_sample:
                logit_rows.append(offset + s.num_tokens - 1)
                row_owner.append((idx, "sample"))
            offset += s.num_tokens

        block_tables = [s.block_table for s in step.rows]
        seq_lens = [s.end for s in step.rows]
        # adapters of this step's rows in slots, the token -> slot mapping set (lora/slots.py)
        adapters = self.lora is not None and self.lora.prepare(step.rows)
        try:
            if (self.graphs is not None and offset == len(step.rows) and not adapters
                    and self.graphs.can_run(offset)):
                # Decode-only (one token per sequence): replay the bucket's CUDA graph.
                hidden = self.graphs.run(input_ids, positions, block_tables, seq_lens)  # [n, H]
            else:
                # Speculative rows (1 + drafts) are decode rows: attended token by token by the
                # decode path (causal within the row), as one-token rows are.
                decode_rows = ([s.num_tokens == 1 or bool(s.spec_token_ids) for s in step.rows]
                               if any(s.spec_token_ids for s in step.rows) else None)
                meta = self._build_meta(block_tables=block_tables, seq_lens=seq_lens,
                                        query_lens=[s.num_tokens for s in step.rows],
                                        device=self.device, decode_rows=decode_rows)
                ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)  # [T]
                pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
                hidden = self.model(ids, pos, self.kv_cache.layers, meta)  # [T, H]
        finally:
            if adapters:
                self.lora.finish()
        pooled = {}
        if self.sample and any(s.pooling is not None for s in step.rows):
            pooled = self.pooler.pool(step.rows, hidden, starts,
                                      getattr(self.model, "classify", None))
        outputs = self._sample(step, hidden, logit_rows, row_owner, offset)
        if pooled:
            for idx, vec in pooled.items():
                outputs[idx].pooled = vec
        return outputs

    def _sample(self, step: StepInput, hidden: torch.Tensor, logit_rows: list[int],
                row_owner: list[tuple[int, str]], offset: int) -> list[SeqStepOutput]:
        """Logits for `logit_rows` of `hidden` and the step's samples (rank 0; [] elsewhere)."""
        if logit_rows == list(range(offset)):  # decode-only: every row, in order
            hidden_rows = hidden  # [R, H]
        else:
            rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
            hidden_rows = hidden.index_select(0, rows)  # [R, H]
        greedy = plain_greedy_rows(step, row_owner)
        if greedy == []:  # nothing to sample (prompt chunks short of their end): no LM head
            return self._greedy_outputs(step, [], torch.empty(0)) if self.sample else []
        if greedy is not None and not self.off_host:
            # NOTE: decided from the step alone, so every tensor-parallel rank takes the same
            # branch (a model that gathers logits returns None on every rank).
            tokens = self.model.greedy_tokens(hidden_rows)  # [R] int64, or None
            if tokens is not None:
                return (accept_plain_greedy(step, self._greedy_outputs(step, greedy, tokens))
                        if self.sample else [])
        logits = self.model.compute_logits(hidden_rows)  # [R, V]
        if not self.sample:
            return []
        if self.off_host:
            if greedy is not None:
                return accept_plain_greedy(step, self._greedy_on_device(step, greedy, logits))
            logits = self._to_host(logits)  # [R, V] float32, pinned
        else:
            logits = logits.float().cpu()  # [R, V]

        outputs = [SeqStepOutput(s.seq_id, []) for s in step.rows]
        sample_rows, sample_idx = [], []
        spec_jobs: list[tuple[int, int, int]] = []  # (row index, first logits row, positions)
        r = 0
        while r < len(row_owner):
            idx, kind = row_owner[r]
            s = step.rows[idx]
            if kind == "sample":
                sample_rows.append(r)
                sample_idx.append(idx)
                r += 1
                continue
            if kind == "spec":  # verified below (worker/spec_verify.py)
                n = len(s.spec_token_ids) + 1
                spec_jobs.append((idx, r, n))
                r += n
                continue
            # Prompt logprobs for this chunk: row p predicts token p + 1 (prompt tokens only).
            n = s.num_tokens
            last_prompt = min(s.end, s.num_prompt_tokens - 1)
            k = s.params.prompt_logprobs or 0
            m = max(0, last_prompt - s.start)
            targets = s.token_ids[s.start + 1 : s.start + 1 + m]
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
                s = step.rows[idx]
                if s.beam_width:  # the row's best 2 * beam_width raw logprobs
                    [(_, _, top)] = logprob_stats(logits[row : row + 1], [0], 2 * s.beam_width)
                    outputs[idx].beam_candidates = top
                    continue
                params = s.params
                # NOTE: a forking group draws all its first tokens from the parent's row, each
                # from its own sequence's stream: distinct and reproducible.
                grammar = step.grammar_bitmask
                for spec in s.samples:
                    rows.append(row)
                    owners.append(idx)
                    reqs.append(SampleRequest(
                        params=params,
                        prompt_token_ids=spec.prompt_token_ids,
                        output_token_ids=spec.output_token_ids,
                        generator=self._generator(s.request_id, params.seed, spec.index),
                        need_logprob=s.need_logprob,
                        token_bitmask=(grammar.bitmask[grammar.rows[spec.seq_id]]
                                       if grammar is not None and spec.seq_id in grammar.rows
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
        for idx, first, n in spec_jobs:
            s = step.rows[idx]
            gen = self._generator(s.request_id, s.params.seed, s.samples[0].index)
            stop = ([] if s.params.ignore_eos else self.eos_ids) + list(s.params.stop_token_ids or [])
            grammar, masks = step.grammar_bitmask, None
            if grammar is not None and s.seq_id in grammar.rows:  # one mask per position
                at = grammar.rows[s.seq_id]
                masks = grammar.bitmask[at : at + n]
            outputs[idx].samples = verify_row(logits[first : first + n], s, gen, stop,
                                              masks=masks)
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
        self.platform.synchronize()
        return out

    def _greedy_on_device(self, step: StepInput, owners: list[int],
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
        self.platform.synchronize()
        return self._greedy_outputs(step, owners, tokens)

    @staticmethod
    def _greedy_outputs(step: StepInput, owners: list[int],
                        tokens: torch.Tensor) -> list[SeqStepOutput]:
        """One plain-greedy sample per row: logits row i's token goes to step row owners[i]."""
        outputs = [SeqStepOutput(s.seq_id, []) for s in step.rows]
        for idx, tok in zip(owners, tokens.tolist()):
            outputs[idx].samples.append(SampleResult(tok, None, None, None))
        return outputs
