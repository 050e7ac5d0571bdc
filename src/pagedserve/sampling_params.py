"""Sampling parameters for text generation, with vLLM's names, defaults and validation.

`SamplingParams` is what a user hands to `LLM.generate` / the OpenAI server. Everything is
checked in `__post_init__`; a bad value raises `ValueError` whose message starts with the
parameter's name, e.g. ``"temperature must be non-negative, got -1.0"``.

Normalisations (all as vLLM does, except where noted):

* ``top_k=-1`` (vLLM 0.x "disabled") becomes ``0``; ``seed=-1`` becomes ``None``.
* ``stop``: a single string becomes a one-element list; ``None`` becomes ``[]``.
* ``stop_token_ids``: ``None`` becomes ``[]``; duplicates are dropped, first occurrence kept.
* ``best_of`` stays ``None`` when not given (so ``dataclasses.replace(p, n=4)`` works);
  `effective_best_of` is the number of sequences to generate.
* ``logprobs=True`` / ``prompt_logprobs=True`` become ``1`` (``False`` becomes ``None``).
* ``logit_bias``: keys given as digit strings (JSON objects have string keys) become ``int``.
* Greedy (``temperature < 1e-5``): ``top_p``, ``top_k`` and ``min_p`` are reset to their
  "disabled" values, since they cannot change an argmax.
* ``1e-5 <= temperature < 1e-2`` is raised to ``1e-2`` (vLLM's guard against inf/nan in
  ``logits / temperature``). vLLM clamps every ``0 < temperature < 1e-2``; we treat
  ``temperature < 1e-5`` as greedy instead, so "almost zero" means greedy.
"""

from __future__ import annotations

import copy
import enum
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from pagedserve.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Smallest non-greedy temperature; smaller ones are raised to it (vLLM's _MAX_TEMP).
MIN_TEMPERATURE = 1e-2


class SamplingType(enum.IntEnum):
    """How the next token is chosen: argmax, or a draw from the global / a per-request RNG."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: Any) -> bool:
    # NOTE: bool is a subclass of int; `top_k=True` is a mistake, not 1.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Sampling parameters for text generation (vLLM-compatible).

    Attributes:
        n: number of output sequences returned for the prompt.
        best_of: number of sequences generated, of which the ``n`` best (by cumulative
            logprob) are returned. Must be ``>= n``; ``None`` means ``n`` (see
            `effective_best_of`).
        presence_penalty: in [-2, 2]; subtracted once from the logit of every token that
            already appears in the output. > 0 encourages new tokens.
        frequency_penalty: in [-2, 2]; subtracted from a token's logit once per occurrence
            in the output.
        repetition_penalty: > 0; logits of tokens seen in the prompt or output are divided
            by it when positive and multiplied when negative. 1 disables it.
        temperature: >= 0; 0 (anything < 1e-5) means greedy.
        top_p: in (0, 1]; nucleus sampling mass. 1 disables it.
        top_k: number of top tokens kept; 0 (or -1, normalised to 0) disables it.
        min_p: in [0, 1]; drop tokens whose probability is below ``min_p`` times the top
            token's. 0 disables it.
        seed: per-request RNG seed, or ``None`` for the engine's generator.
        stop: strings that end generation; the output excludes them unless
            ``include_stop_str_in_output``.
        stop_token_ids: token ids that end generation (kept in the output token ids; the
            text leaves the stopping token out, as it does EOS, unless
            ``include_stop_str_in_output``).
        ignore_eos: keep generating after EOS.
        max_tokens: maximum number of generated tokens per sequence; ``None`` means up to
            the model's context length (resolved by the engine).
        min_tokens: EOS and ``stop_token_ids`` are blocked until this many tokens exist.
        logprobs: number of top logprobs returned per output token (the sampled token's
            logprob is always included, so up to ``logprobs + 1`` entries), or ``None``; -1:
            the whole vocabulary (when the engine's ``max_logprobs`` is -1).
        prompt_logprobs: the same for each prompt token, or ``None``.
        skip_special_tokens: drop special tokens from the output text.
        spaces_between_special_tokens: join added tokens with spaces (slow tokenizers only,
            as in vLLM).
        include_stop_str_in_output: keep the matched stop string in the output text.
        logit_bias: ``{token_id: bias}`` added to the logits before sampling.
        allowed_token_ids: only these token ids may be sampled (the rest are masked), or None.
        bad_words: words never generated: a word's last token is masked whenever the output
            ends with the word's other tokens (each word with and without a leading space). The
            engine tokenizes them into ``bad_words_token_ids``.
        cache_salt: a non-empty string isolating the request's prefix-cache hits: it shares
            cached blocks only with requests of the same salt (vLLM takes it with the prompt).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = field(default=None)
    # Beam search through the sampling API (vLLM v0's, and its server's `use_beam_search`):
    # `n` is the beam width; the engine runs `core.beam_search` for such a request.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None  # set by the engine from bad_words
    cache_salt: str | None = None
    # Structured outputs (vLLM's name): the output matches a JSON schema / regex / choice /
    # grammar; see `structured_output`. A dict is read as StructuredOutputsParams(**dict).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._normalise()
        self._verify()
        if self.temperature < SAMPLING_EPS:
            # NOTE: greedy ignores the truncation knobs (as vLLM does). They are validated
            # above first, so an invalid top_p is an error even with temperature=0.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        elif self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s, which may give inf/nan logits; using %s",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE

    # ------------------------------------------------------------------ validation

    def _normalise(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"
            )

        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        if _is_int(self.seed) and self.seed == -1:
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:
                setattr(self, name, 1)
            elif value is False:
                setattr(self, name, None)
        if self.logit_bias is not None:
            self.logit_bias = _normalise_logit_bias(self.logit_bias)
        self.structured_outputs = _normalise_structured_outputs(self.structured_outputs)

    def _verify(self) -> None:
        self.n = _check_int("n", self.n, minimum=1)
        if self.best_of is not None:
            self.best_of = _check_int("best_of", self.best_of, minimum=1)
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} and "
                f"best_of={self.best_of}"
            )

        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_real(name, getattr(self, name))
            setattr(self, name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        self.repetition_penalty = _check_real("repetition_penalty", self.repetition_penalty)
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be a finite number greater than zero, "
                f"got {self.repetition_penalty}"
            )

        self.temperature = _check_real("temperature", self.temperature)
        if math.isnan(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}")
        self.top_p = _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < 0:  # -1 was normalised to 0 already
            raise ValueError(f"top_k must be 0 or -1 (disabled), or at least 1, got {self.top_k}")
        self.top_k = int(self.top_k)
        self.min_p = _check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        self.length_penalty = _check_real("length_penalty", self.length_penalty)
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
        if self.use_beam_search:
            if self.structured_outputs is not None:
                raise ValueError("structured_outputs is not supported with use_beam_search")
            if self.temperature >= SAMPLING_EPS:
                raise ValueError(
                    f"temperature must be 0 with use_beam_search, got {self.temperature}")
            if self.best_of is not None and self.best_of != self.n:
                raise ValueError(f"best_of must equal n (the beam width) with use_beam_search, "
                                 f"got best_of={self.best_of}, n={self.n}")
        # Greedy gives the same sequence n times; vLLM refuses it (beam search is not greedy).
        elif self.temperature < SAMPLING_EPS:
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}")
            if self.effective_best_of > 1:
                raise ValueError(
                    f"best_of must be 1 when using greedy sampling, got {self.best_of}"
                )

        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None:
            self.seed = int(self.seed)
            # NOTE: torch.Generator.manual_seed takes a signed or unsigned 64-bit integer; a
            # larger seed would raise inside the model step.
            if not -(2**63) <= self.seed < 2**64:
                raise ValueError(f"seed must fit in 64 bits, got {self.seed}")

        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens, minimum=1)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}"
            )

        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, minimum=-1)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs,
                                              minimum=-1)

        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if not s:
                raise ValueError("stop cannot contain an empty string")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(
                    f"stop_token_ids must contain only non-negative integers, got {t!r}"
                )
        # Dedupe, keeping the first occurrence (vLLM does the same).
        self.stop_token_ids = list(dict.fromkeys(int(t) for t in self.stop_token_ids))

        self._verify_token_lists()
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _verify_token_lists(self) -> None:
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not all(
                    _is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a list of non-negative integers, "
                                 f"got {self.allowed_token_ids!r}")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) for w in self.bad_words):
                raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
            self.bad_words = list(self.bad_words)

    # ------------------------------------------------------------------ properties

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY when ``temperature < 1e-5``, else RANDOM_SEED with a seed, else RANDOM."""
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def effective_best_of(self) -> int:
        """Sequences to generate: ``best_of``, or ``n`` when it is None."""
        return self.n if self.best_of is None else self.best_of

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax (``temperature < 1e-5``)."""
        return self.sampling_type is SamplingType.GREEDY

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a streaming output must hold back while unfinished.

        A stop string may be split across steps; without holding back the last
        ``max(len(stop)) - 1`` characters, a stream could send the beginning of a stop
        string that the final text then drops. 0 when stop strings are kept in the output.
        """
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def clone(self) -> SamplingParams:
        """A deep copy (the lists and dict are not shared with the original)."""
        return copy.deepcopy(self)


# ---------------------------------------------------------------------- helpers


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        bound = "at least 1" if minimum == 1 else f"greater than or equal to {minimum}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return int(value)


def _check_real(name: str, value: Any) -> float:
    if not _is_real(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _normalise_structured_outputs(value: Any) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        try:
            return StructuredOutputsParams(**value)
        except TypeError as e:  # an unknown key
            raise ValueError(f"structured_outputs: {e}") from None
    raise ValueError("structured_outputs must be StructuredOutputsParams or a dict, got "
                     f"{type(value).__name__}")


def _normalise_logit_bias(logit_bias: Any) -> dict[int, float]:
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {logit_bias!r}")
    out: dict[int, float] = {}
    for key, bias in logit_bias.items():
        if _is_int(key):
            token_id = int(key)
        elif isinstance(key, str) and key.strip().isdecimal():
            token_id = int(key.strip())
        else:
            raise ValueError(f"logit_bias keys must be integer token ids, got {key!r}")
        if token_id < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}")
        if not _is_real(bias) or not math.isfinite(bias):
            raise ValueError(
                f"logit_bias values must be finite numbers, got {bias!r} for token {token_id}"
            )
        out[token_id] = float(bias)
    return out
