"""What a step's outputs look like to callers: `RequestOutput`s built from a request's group (text,
token ids, logprobs in vLLM's format, beams, pooled results), mixed into `LLMEngine`."""

from __future__ import annotations

import sys

from pagedserve.core.beam_search import Hypothesis, final_hypotheses
from pagedserve.engine.detokenizer import decode_token
from pagedserve.engine.pooling import pooling_output
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.sequence import SequenceGroup

_getrefcount = sys.getrefcount


class HandedOut:
    """The tail `source[start:]` of an append-only list (a sequence's output token ids, its
    output logprobs), handed out in a request's output every step without copying the whole
    tail every step.

    `take` returns a list equal to `source[start:]`. When nobody but this holder still refers to
    the list handed out last time (the caller dropped that output), that list is extended in
    place with the new items and handed out again; otherwise (an output kept by the caller) a
    fresh copy is made, as before. So a list a caller holds is never changed by the engine.

    NOTE (step cost): copying the whole tail every step made a request's outputs cost O(length)
    per step (O(length^2) over its life), and every copy's items were visited again by the
    garbage collector's young-generation pass (the outputs are alive when it runs) and by the
    copy's deallocation: at 1024 sequences of ~50 output tokens ~200 thousand scattered objects
    touched per step. NOTE: relies on CPython's reference counts (`sys.getrefcount`, calibrated
    at import by `_SOLE`); a list the caller changed in place and then dropped is reused only
    while its length and last item are the ones handed out (callers must treat outputs as
    read-only, as vLLM's).
    """

    __slots__ = ("items", "count")

    def __init__(self) -> None:
        self.items: list | None = None
        self.count = 0  # len(items) when handed out

    def _refs(self) -> int:
        # NOTE: the same steps as `take`'s check (the list in a local, then counted), so that
        # `_SOLE` counts whatever references the interpreter adds for them.
        items = self.items
        return _getrefcount(items)

    def take(self, source: list, start: int) -> list:
        """A list equal to `source[start:]` (see the class docstring)."""
        items = self.items
        count = self.count
        n = len(source) - start
        if (items is not None and _getrefcount(items) <= _SOLE and len(items) == count
                and count <= n and (not count or items[-1] is source[start + count - 1])):
            if n > count:
                items += source[start + count:]
        else:
            items = self.items = source[start:]
        self.count = n
        return items


def _sole_refs() -> int:
    probe = HandedOut()
    probe.items = []
    return probe._refs()


# The reference count `HandedOut.take` sees for a list held by its holder alone (3 on CPython
# 3.11: the holder, the local, the call's argument).
_SOLE = _sole_refs()


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
        outs = []
        for i, seq in enumerate(seqs):
            tokens = seq.handed_tokens
            if tokens is None:
                tokens = seq.handed_tokens = HandedOut()
            logprobs = None
            if with_lp:
                handed = seq.handed_logprobs
                if handed is None:
                    handed = seq.handed_logprobs = HandedOut()
                logprobs = handed.take(seq.output_logprobs, 0)
            outs.append(CompletionOutput(
                i,  # index
                seq.final_text if seq.final_text is not None else seq.detokenizer.text,
                tokens.take(seq.token_ids, seq.num_prompt_tokens),
                seq.cumulative_logprob if want_lp else None,
                logprobs,
                seq.status.value if seq.is_finished else None,  # finish_reason
                seq.stop_reason,
            ))
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
