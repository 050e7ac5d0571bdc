"""The front end's output processor: the engine cores' token deltas -> `RequestOutput`s.

Per request it keeps what the in-process engine keeps per sequence for text: an incremental
detokenizer, the output tokens, the logprob entries (raw values from the core, formatted here
with their tokens' text), the cumulative logprob, and the stop strings, checked token by token
with `LLMEngine.on_token`'s rule (after `min_tokens`, not on a token that stops by id, not after
a grammar ended). A stop string ends the sequence here at once: what the core computed past it is
dropped, and the core is told (`stop_seqs`: the sequence ends at its next token there; or the
request is aborted when nothing of it is left). So a request's tokens, logprobs, text and finish
reasons are exactly the in-process engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.core_messages import RequestDelta
from pagedserve.engine.detokenizer import IncrementalDetokenizer, TokenizerInfo, find_stop
from pagedserve.engine.output_builder import OutputBuilder
from pagedserve.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pagedserve.sampling_params import SamplingParams


class _NoText:
    text = ""

    def append(self, token_ids) -> str:
        return ""


class SeqState:
    """One sequence as the front end sees it."""

    __slots__ = ("index", "detok", "token_ids", "logprobs", "cumulative", "finish_reason",
                 "stop_reason", "final_text", "done")

    def __init__(self, index: int, detok) -> None:
        self.index = index
        self.detok = detok
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.cumulative = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.final_text: str | None = None
        self.done = False


@dataclass
class RequestState:
    """One request in flight in the front end."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | None  # None: a pooling request
    arrival_time: float
    seqs: list[SeqState] = field(default_factory=list)
    prompt_logprobs: list | None = None
    finished: bool = False
    engine_index: int = 0
    num_generated: int = 0  # output tokens so far (all sequences), for stats and load


class OutputProcessor(OutputBuilder):
    """Requests' states and the `RequestOutput`s built from the cores' deltas (see the module
    docstring). `tokenizer` None: no text (skip_tokenizer_init)."""

    def __init__(self, tokenizer, eos_token_ids) -> None:
        self.tokenizer = tokenizer
        self.tokenizer_info = TokenizerInfo.from_tokenizer(tokenizer) if tokenizer else None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams | None, arrival_time: float,
            engine_index: int = 0) -> RequestState:
        """Track a request the core accepted (or is about to)."""
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, arrival_time,
                             engine_index=engine_index)
        if params is not None and not params.use_beam_search:
            for index in range(params.best_of or params.n):
                state.seqs.append(SeqState(index, self._detokenizer(params, prompt_token_ids)))
            if params.prompt_logprobs is not None:
                state.prompt_logprobs = []
        self.requests[request_id] = state
        return state

    def _detokenizer(self, params: SamplingParams, prompt_token_ids: list[int]):
        if self.tokenizer is None:
            return _NoText()
        return IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            tokenizer_info=self.tokenizer_info)

    def forget(self, request_id: str) -> RequestState | None:
        return self.requests.pop(request_id, None)

    # --- a delta -----------------------------------------------------------------------------

    def process(self, delta: RequestDelta) -> tuple[object | None, list[int], bool]:
        """Apply one core delta. Returns (the request's output or None when it is unknown,
        the sequence indices a stop string ended here, whether the core must abort the request
        because the front end finished it first)."""
        state = self.requests.get(delta.request_id)
        if state is None or state.finished:
            return None, [], False
        if state.params is None:
            return self._pooling_output(state, delta), [], False
        if delta.beams is not None:
            return self._beam_output(state, delta), [], False
        params = state.params
        if delta.prompt_logprobs and state.prompt_logprobs is not None:
            for entry in delta.prompt_logprobs:
                state.prompt_logprobs.append(
                    None if entry is None else self._logprob_dict(*entry))
        stopped: list[int] = []
        seqs = state.seqs
        for d in delta.seqs:
            seq = seqs[d.index]
            if seq.done:
                continue
            if self._apply_tokens(state, seq, d, params):
                stopped.append(d.index)
        finished = all(s.done for s in seqs)
        abort = finished and not delta.finished
        if finished:
            state.finished = True
            del self.requests[state.request_id]
        return self._output(state, delta, finished), stopped, abort

    def _apply_tokens(self, state: RequestState, seq: SeqState, d, params: SamplingParams) -> bool:
        """Append a sequence's new tokens with `LLMEngine.on_token`'s rule; True when a stop
        string ended it here (before the core knew)."""
        eos = self.eos_token_ids
        tokens = d.token_ids
        last = len(tokens) - 1
        sample_lps = d.sample_logprobs
        entries = d.logprobs
        num_prompt = len(state.prompt_token_ids)
        for j, token in enumerate(tokens):
            if entries is not None:
                seq.logprobs.append(self._logprob_dict(*entries[j]))
            if sample_lps is not None:
                seq.cumulative += sample_lps[j] or 0.0
            seq.token_ids.append(token)
            state.num_generated += 1
            past_min = len(seq.token_ids) >= params.min_tokens
            stops = past_min and ((not params.ignore_eos and token in eos)
                                  or token in params.stop_token_ids)
            if stops and not params.include_stop_str_in_output:
                seq.final_text = seq.detok.text  # as the in-process engine: EOS's text dropped
            new_text = seq.detok.append(token)
            core_end = j == last and d.finish_reason is not None
            # NOTE: a grammar that ended stops the sequence before any stop string is looked
            # for (the core reports it as "stop" without a stop reason, on a token that does
            # not stop by id).
            grammar_end = (core_end and d.finish_reason == "stop" and d.stop_reason is None
                           and not stops)
            if not stops and past_min and params.stop and new_text and not grammar_end:
                cut, matched = find_stop(seq.detok.text, len(new_text), params.stop,
                                         params.include_stop_str_in_output)
                if matched is not None:
                    seq.final_text = seq.detok.text[:cut]
                    seq.stop_reason = matched
                    seq.finish_reason = "stop"
                    seq.done = True
                    return not core_end
            if core_end:
                seq.finish_reason = d.finish_reason
                seq.stop_reason = d.stop_reason
                seq.done = True
        if not tokens and d.finish_reason is not None:  # ended without a token (length cap)
            seq.finish_reason = d.finish_reason
            seq.stop_reason = d.stop_reason
            seq.done = True
        return False

    # --- outputs -----------------------------------------------------------------------------

    @staticmethod
    def _metrics(state: RequestState, delta: RequestDelta) -> RequestMetrics:
        return RequestMetrics(state.arrival_time, delta.first_scheduled_time,
                              delta.first_token_time, delta.finished_time)

    def _output(self, state: RequestState, delta: RequestDelta, finished: bool) -> RequestOutput:
        params = state.params
        seqs = state.seqs
        if len(seqs) > params.n:  # best_of: the n with the highest cumulative logprob
            seqs = sorted(seqs, key=lambda q: q.cumulative, reverse=True)[: params.n]
        p = params
        want_lp = p.logprobs is not None or (p.best_of or p.n) > p.n
        with_lp = p.logprobs is not None
        outs = [CompletionOutput(
            i, seq.final_text if seq.final_text is not None else seq.detok.text,
            list(seq.token_ids), seq.cumulative if want_lp else None,
            list(seq.logprobs) if with_lp else None, seq.finish_reason, seq.stop_reason)
            for i, seq in enumerate(seqs)]
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids,
            None if state.prompt_logprobs is None else list(state.prompt_logprobs), outs,
            finished, self._metrics(state, delta), delta.num_preemptions, [],
            delta.num_cached_tokens)

    def _beam_output(self, state: RequestState, delta: RequestDelta) -> RequestOutput:
        finished = delta.finished
        outs = [CompletionOutput(
            index=i,
            text=("" if self.tokenizer is None
                  else self.tokenizer.decode(h.token_ids, skip_special_tokens=True)),
            token_ids=list(h.token_ids), cumulative_logprob=h.cumulative_logprob, logprobs=None,
            finish_reason=h.finish_reason) for i, h in enumerate(delta.beams)]
        if finished:
            state.finished = True
            self.requests.pop(state.request_id, None)
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, prompt_logprobs=None, outputs=outs,
            finished=finished, num_preemptions=delta.num_preemptions,
            metrics=self._metrics(state, delta))

    def _pooling_output(self, state: RequestState, delta: RequestDelta) -> PoolingRequestOutput:
        data = None
        if delta.pooled is not None:
            import torch

            raw, shape, dtype = delta.pooled
            dt = getattr(torch, dtype.removeprefix("torch."))
            data = torch.frombuffer(bytearray(raw), dtype=dt).reshape(shape)
        if delta.finished:
            state.finished = True
            self.requests.pop(state.request_id, None)
        return PoolingRequestOutput(
            request_id=state.request_id, outputs=PoolingOutput(data),
            prompt_token_ids=state.prompt_token_ids, finished=delta.finished,
            prompt=state.prompt, metrics=self._metrics(state, delta),
            num_preemptions=delta.num_preemptions, num_cached_tokens=delta.num_cached_tokens)
