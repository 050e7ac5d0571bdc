"""Results returned to users, in vLLM's shapes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability (raw log-softmax of the model), its 1-based rank over the
    vocabulary, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the top-k plus the sampled or actual token).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after a step (or at its end)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_preemptions: int = 0
    new_text: list[str] = field(default_factory=list)
    # Prompt tokens served from the prefix cache (vLLM's num_cached_tokens).
    num_cached_tokens: int | None = None


# --- pooling (vLLM's shapes) ------------------------------------------------------------------


@dataclass
class PoolingOutput:
    """A pooling request's result: `data` is a float32 CPU tensor ([H], or [T, H] for the
    token_embed task; None if the request was aborted)."""

    data: object


@dataclass
class PoolingRequestOutput:
    """The result of one pooling request (`LLM.encode`, the server's pooling routes)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    num_preemptions: int = 0
    num_cached_tokens: int | None = None


@dataclass
class EmbeddingOutput:
    """One embedding as a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = out.outputs.data
        if data is None or data.dim() != 1:
            raise ValueError("an embedding is one vector per prompt (task 'embed')")
        return cls(out.request_id, EmbeddingOutput(data.tolist()), out.prompt_token_ids,
                   out.finished)


@dataclass
class ScoringOutput:
    """One similarity score."""

    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result for one (text_1, text_2) pair; `prompt_token_ids` are both texts'."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    """A classifier's class probabilities (after its activation)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """`LLM.classify`'s result for one prompt."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, ClassificationOutput(out.outputs.data.tolist()),
                   out.prompt_token_ids, out.finished)
