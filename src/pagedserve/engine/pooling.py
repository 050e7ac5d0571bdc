"""The engine's side of the pooling runner (`runner="pooling"`): which runner a model gets, a
pooling request's resolved `PoolingSpec` (its checks raise ValueError naming the parameter), and
its output.

A pooling request is a prefill-only request: the scheduler admits, chunks, batches, preempts and
prefix-caches it like any other; it finishes when its prompt is computed (no token is decoded),
and its blocks are freed then.
"""

from __future__ import annotations

from typing import Any

from pagedserve.models.base import head_kind
from pagedserve.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
from pagedserve.pooling_params import PoolerConfig, PoolingParams, PoolingSpec
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import SequenceGroup

# What the scheduler sees of a pooling request: one sequence, one position past its prompt
# (never decoded: the request finishes when its prompt is computed).
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


def resolve_runner(option: str, config: Any) -> str:
    """"generate" or "pooling": as asked, or for "auto" pooling when the checkpoint has no LM
    head (a bare base model saved by `AutoModel`: `LlamaModel`, `Qwen3Model`, ...; or a
    `*ForSequenceClassification`), else generate."""
    if option != "auto":
        return option
    return "generate" if head_kind(config) == "lm" else "pooling"


def classifier_activation(config: Any) -> str:
    """The activation of a classifier's logits, as vLLM (after transformers' losses): none for
    regression, sigmoid for multi-label or a single label, else softmax."""
    problem = getattr(config, "problem_type", None) or ""
    if problem == "regression":
        return "none"
    if problem == "multi_label_classification" or int(config.num_labels) < 2:
        return "sigmoid"
    return "softmax"


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
    classifier = head_kind(config) == "classifier"
    task = params.task or ("classify" if classifier else "embed")
    if task == "classify":
        if not classifier:
            raise ValueError(
                "task='classify': this model has no classification head (the `score` layer of a "
                "*ForSequenceClassification checkpoint); it is served as an embedding model: use "
                "task 'embed' (cosine scores: LLM.score, /v1/score)")
        if params.dimensions is not None:
            raise ValueError("dimensions: only embeddings can be shortened, not class "
                             "probabilities")
        act = params.use_activation if params.use_activation is not None else params.normalize
        return PoolingSpec("LAST", False, None,
                           classifier_activation(config) if act is not False else "none")
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


def check_pooling_fits(prompt_len: int, kv_manager: Any, num_kv_blocks: int) -> SamplingParams:
    """ValueError unless a pooling request's prompt fits the KV cache (its blocks, and the KV
    manager's own check); the SamplingParams the scheduler sees for it."""
    # (every layer group's blocks: the whole prompt may be one chunk)
    blocks = kv_manager.blocks_for(prompt_len, prompt_len)
    if blocks > num_kv_blocks:
        raise ValueError(
            f"prompt of {prompt_len} tokens needs {blocks} KV blocks; the cache has "
            f"{num_kv_blocks} (raise kv_cache_memory or shorten the prompt)")
    kv_manager.check_request(1, False, prompt_len, prompt_len)
    return POOLING_SAMPLING


def pooling_output(group: SequenceGroup, finished: bool) -> PoolingRequestOutput:
    """A pooling group's output (its data None unless its prompt was computed)."""
    return PoolingRequestOutput(
        request_id=group.request_id, outputs=PoolingOutput(group.pooled),
        prompt_token_ids=group.prompt_token_ids, finished=finished, prompt=group.prompt,
        metrics=RequestMetrics(group.arrival_time, group.first_scheduled_time,
                               group.first_token_time, group.finished_time),
        num_preemptions=group.num_preemptions, num_cached_tokens=group.num_cached_tokens)
