"""The model runner: owns the model and the KV cache tensors, turns a scheduled step into one flat
batch, runs the model and samples. It knows nothing of queues or preemption."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.worker.kv_cache import KVCache
from pagedserve.worker.sampler import SampleRequest, SampleResult, prompt_logprobs, sample


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
    ) -> None:
        self.model = model
        self.sample = sample
        self.kv_cache = kv_cache
        self.device = device
        self.eos_ids = list(stop_token_ids_for_min_tokens)
        self.generators: dict[str, torch.Generator] = {}

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

        meta = AttentionMetadata.build(
            block_tables=[s.block_table for s in step.scheduled],
            seq_lens=[s.end for s in step.scheduled],
            query_lens=[s.num_tokens for s in step.scheduled],
            block_size=self.kv_cache.block_size,
            null_block=self.kv_cache.null_block,
            device=self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)  # [T]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        hidden = self.model(ids, pos, self.kv_cache.layers, meta)  # [T, H]
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # [R, V]
        if not self.sample:
            return []
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
                if s.group.beam is not None:
                    lp = torch.log_softmax(logits[row], dim=-1)  # [V] raw logprobs
                    vals, tok = torch.topk(lp, 2 * s.group.beam.params.beam_width)
                    outputs[idx].beam_candidates = list(zip(tok.tolist(), vals.tolist()))
                    continue
                params = s.group.sampling_params
                gen = self._generator(s.group.request_id, params.seed)
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
                    ))
            stop_ids = [
                ([] if r_.params.ignore_eos else self.eos_ids) + list(r_.params.stop_token_ids or [])
                for r_ in reqs
            ]
            results = sample(logits[rows], reqs, stop_ids) if rows else []
            for idx, res in zip(owners, results):
                outputs[idx].samples.append(res)
        return outputs
