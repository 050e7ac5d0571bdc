"""The front end's input processor: a request's text -> the token ids and parameters an engine
core takes (vLLM v1's Processor).

It tokenizes prompts (chat templates are rendered before, by `engine/chat_template.py`, for
the server and `LLM.chat`), resolves what needs the tokenizer (`bad_words` -> token ids),
checks what only text can break (stop strings without a tokenizer), and builds the
`CoreRequest`: the sampling
parameters without their stop strings, which stay with the output processor. Everything that
needs the engine's sizes (prompt length, logprobs, blocks) is checked by the core when it takes
the request; its refusal comes back as the same ValueError.
"""

from __future__ import annotations

import time

from pagedserve.engine.core_messages import CoreRequest
from pagedserve.models.tokenizer import bad_words_token_ids
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams


class Processor:
    """Builds `CoreRequest`s (see the module docstring); `tokenizer` None: token ids only."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: the engine runs without a tokenizer (skip_tokenizer_init): "
                             "give prompt_token_ids")
        return list(self.tokenizer(prompt).input_ids)

    def prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        """The prompt's token ids (tokenized here when only text is given)."""
        if prompt_token_ids is not None:
            return list(prompt_token_ids)
        if prompt is None:
            raise ValueError("prompt: either a prompt or prompt_token_ids is required")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        return self.tokenize(prompt)

    def core_params(self, params: SamplingParams | PoolingParams):
        """The parameters as the core takes them: SamplingParams without stop strings and with
        `bad_words` resolved to token ids (a copy when anything changes)."""
        if isinstance(params, PoolingParams):
            return params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer (the engine runs with "
                             "skip_tokenizer_init); use stop_token_ids")
        if not params.stop and not (params.bad_words and params.bad_words_token_ids is None):
            return params
        params = params.clone()
        params.stop = []
        if params.bad_words and params.bad_words_token_ids is None:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer (the engine runs with "
                                 "skip_tokenizer_init)")
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        return params

    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams | PoolingParams, arrival_time: float | None = None,
                     priority: int = 0, lora_request=None,
                     validate_only: bool = False) -> CoreRequest:
        core = self.core_params(params)
        pooling = isinstance(core, PoolingParams)
        return CoreRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids,
            sampling_params=None if pooling else core, pooling_params=core if pooling else None,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority, lora_request=lora_request, validate_only=validate_only)
