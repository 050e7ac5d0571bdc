"""What a step's outputs look like to callers: `RequestOutput`s built from a request's group (text,
token ids, logprobs in vLLM's format, beams, pooled results), mixed into `LLMEngine`."""

from __future__ import annotations

from pagedserve.core.beam_search import Hypothesis, final_hypotheses
from pagedserve.engine.detokenizer import decode_token
from pagedserve.engine.pooling import pooling_output
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.sequence import SequenceGroup


class OutputBuilder:
    """`LLMEngine`'s output building (reads `self.tokenizer` only)."""

    tokenizer: object | None

    def _logprob_dict(self, token: int, lp: float, rank: int, top) -> dict[int, Logprob]:
        # NOTE: the chosen (or prompt) token first, then the top-k by rank, as vLLM orders them
        # (its server's top_logprobs follow this order).
        entry = {token: Logprob(lp, rank, self._decode_token(token))}
        for i, (tid, tlp) in enumerate(top):
            if tid != token:
                entry[tid] = Logprob(tlp, i + 1, self._decode_token(tid))
        return entry

    def _decode_token(self, token: int) -> str | None:
        # NOTE (step cost): every logprob entry shows its token's text: decoded once per token id
        # (a pure function of the tokenizer; the cache holds at most the vocabulary).
        if self.tokenizer is None:
            return None
        cache = self.__dict__.get("_token_texts")
        if cache is None:
            cache = self._token_texts = {}
        text = cache.get(token)
        if text is None:
            text = cache[token] = decode_token(self.tokenizer, token)
        return text

    def _make_beam_output(self, group: SequenceGroup, finished: bool) -> RequestOutput:
        hyps = group.extra.get("beam_final") if finished else None
        if hyps is None and finished:
            # Ended without a last beam step (aborted): the beams it had are its hypotheses.
            hyps = final_hypotheses(group.beam, [(q.cumulative_logprob, q.output_token_ids)
                                                 for q in group.seqs])
        if hyps is None:
            hyps = [Hypothesis(q.output_token_ids, q.cumulative_logprob, q.cumulative_logprob,
                               q.status.finish_reason) for q in group.unfinished_seqs()]
        outs = [
            CompletionOutput(
                index=i,
                text=("" if self.tokenizer is None
                      else self.tokenizer.decode(h.token_ids, skip_special_tokens=True)),
                token_ids=list(h.token_ids),
                cumulative_logprob=h.cum_logprob,
                logprobs=None,
                finish_reason=h.finish_reason,
            )
            for i, h in enumerate(hyps)
        ]
        return RequestOutput(
            request_id=group.request_id, prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids, prompt_logprobs=None, outputs=outs,
            finished=finished, num_preemptions=group.num_preemptions,
            metrics=RequestMetrics(group.arrival_time, group.first_scheduled_time,
                                   group.first_token_time, group.finished_time),
        )

    def _make_output(self, group: SequenceGroup, finished: bool) -> RequestOutput:
        if group.pooling is not None:
            return pooling_output(group, finished)
        if group.beam is not None:
            return self._make_beam_output(group, finished)
        params = group.sampling_params
        seqs = group.seqs
        if len(seqs) > params.n:  # best_of: the n with the highest cumulative logprob
            seqs = sorted(seqs, key=lambda q: q.cumulative_logprob, reverse=True)[: params.n]
        want_lp = group.needs_logprobs
        with_lp = params.logprobs is not None
        # NOTE (step cost): built once per request per step: positional arguments (half the cost
        # of keywords), in the dataclasses' field order.
        outs = [
            CompletionOutput(
                i,  # index
                seq.final_text if seq.final_text is not None else seq.detokenizer.text,
                seq.token_ids[seq.num_prompt_tokens:],  # (a copy)
                seq.cumulative_logprob if want_lp else None,
                list(seq.output_logprobs) if with_lp else None,
                seq.status.value if seq.is_finished else None,  # finish_reason
                seq.stop_reason,
            )
            for i, seq in enumerate(seqs)
        ]
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.seqs[0].prompt_token_ids,
            group.prompt_logprobs,
            outs,
            finished,
            RequestMetrics(group.arrival_time, group.first_scheduled_time,
                           group.first_token_time, group.finished_time),
            group.num_preemptions,
            [],  # new_text
            group.num_cached_tokens,
        )
