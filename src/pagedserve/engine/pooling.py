"""The engine's side of the pooling runner (`runner="pooling"`): which runner a model gets, a
pooling request's resolved `PoolingSpec` (its checks raise ValueError naming the parameter), and
its output.

A pooling request is a prefill-only request: the scheduler admits, chunks, batches, preempts and
prefix-caches it like any other; it finishes when its prompt is computed (no token is decoded),
and its blocks are freed then.
"""

from __future__ import annotations

from typing import Any

from pagedserve.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
from pagedserve.pooling_params import PoolerConfig, PoolingParams, PoolingSpec
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import SequenceGroup

# What the scheduler sees of a pooling request: one sequence, one position past its prompt
# (never decoded: the request finishes when its prompt is computed).
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


def resolve_runner(option: str, config: Any) -> str:
    """"generate" or "pooling": as asked, or for "auto" pooling when every architecture the
    config names is a bare base model (`LlamaModel`, `Qwen3Model`, ...: saved by `AutoModel`,
    no LM head), else generate."""
    if option != "auto":
        return option
    archs = list(getattr(config, "architectures", None) or [])
    return "pooling" if archs and all(a.endswith("Model") and not a.endswith("LMHeadModel")
                                      for a in archs) else "generate"


def hidden_size(config: Any) -> int:
    """The width of the model's final hidden states (what pooling returns)."""
    return int(getattr(config, "word_embed_proj_dim", None) or config.hidden_size)


def is_matryoshka(config: Any) -> tuple[bool, list[int] | None]:
    """(whether the model may be truncated, the allowed dimensions or None for any), as vLLM
    reads it: `is_matryoshka` or `matryoshka_dimensions` in the model's config."""
    dims = getattr(config, "matryoshka_dimensions", None)
    return bool(getattr(config, "is_matryoshka", False) or dims is not None), dims


def check_runner(runner: str, params: Any) -> None:
    """ValueError naming the runner when a request does not fit the engine's runner."""
    if isinstance(params, PoolingParams):
        if runner != "pooling":
            raise ValueError(
                "pooling requests (embeddings, pooling, scores) need the pooling runner: this "
                f"engine runs runner='{runner}'; start it with runner='pooling' (--runner "
                "pooling)")
        return
    if runner == "pooling":
        raise ValueError(
            "generation requests need the generate runner: this engine runs runner='pooling' "
            "(embeddings, pooling and scores only); start it with runner='generate' (--runner "
            "generate)")


def pooling_spec(params: PoolingParams, pooler: PoolerConfig, config: Any,
                 model_name: str, hidden_size: int) -> PoolingSpec:
    """The request's pooling; ValueError (naming the parameter) when the model cannot serve it."""
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
    task = params.task or "embed"
    if task in ("classify", "score"):
        raise ValueError(
            f"task={task!r}: this model has no classification head (a `score` / classifier "
            "layer over the pooled state); the pooling runner serves decoder models as embedding "
            "models: use task 'embed' (cosine scores: LLM.score, /v1/score)")
    normalize = params.normalize if params.normalize is not None else params.use_activation
    if normalize is None:
        normalize = pooler.normalize
    dims = params.dimensions
    if dims is not None:
        allowed, listed = is_matryoshka(config)
        if not allowed:
            raise ValueError(
                f'dimensions: Model "{model_name}" does not support matryoshka representation, '
                "changing output dimensions will lead to poor results.")
        if listed is not None and dims not in listed:
            raise ValueError(
                f'dimensions: Model "{model_name}" only supports {list(listed)} matryoshka '
                "dimensions, use other output dimensions will lead to poor results.")
        if dims > hidden_size:
            raise ValueError(f"dimensions={dims} is more than the model's hidden size "
                             f"({hidden_size})")
    kind = "ALL" if task == "token_embed" else pooler.pooling_type
    return PoolingSpec(kind, bool(normalize), dims)


def pooling_output(group: SequenceGroup, finished: bool) -> PoolingRequestOutput:
    """A pooling group's output (its data None unless its prompt was computed)."""
    return PoolingRequestOutput(
        request_id=group.request_id, outputs=PoolingOutput(group.pooled),
        prompt_token_ids=group.prompt_token_ids, finished=finished, prompt=group.prompt,
        metrics=RequestMetrics(group.arrival_time, group.first_scheduled_time,
                               group.first_token_time, group.finished_time),
        num_preemptions=group.num_preemptions, num_cached_tokens=group.num_cached_tokens)
