"""`LLM`'s pooling methods (vLLM's): `encode`, `embed`, `score` and `classify`, for an engine
started with `runner="pooling"`. Mixed into `engine.llm.LLM`."""

from __future__ import annotations

from typing import Any, Sequence as Seq

import torch

from pagedserve.engine.pooling import check_runner, hidden_size, pooling_spec
from pagedserve.models.base import head_kind
from pagedserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedserve.pooling_params import POOLING_TASKS, PoolingParams

PromptType = str | dict[str, Any]


class PoolingMixin:
    """The pooling half of `LLM` (`self.engine` is its `LLMEngine`)."""

    engine: Any

    def encode(
        self,
        prompts: PromptType | Seq[PromptType],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt's final hidden states; outputs in input order, `.outputs.data` a
        float32 tensor: [H] for `pooling_task="embed"`, [T, H] for "token_embed" (one vector
        per prompt token). As in vLLM, `pooling_task` is required."""
        if pooling_task is None:
            raise ValueError(
                "pooling_task required for `LLM.encode`: use `LLM.embed(...)` or "
                "pooling_task='embed' for embeddings, pooling_task='token_embed' for one vector "
                "per prompt token, `LLM.score(...)` for similarity scores")
        if pooling_task not in POOLING_TASKS:
            raise ValueError(f"pooling_task must be one of {POOLING_TASKS}, got {pooling_task!r}")
        return self._pool(prompts, pooling_params, pooling_task, truncate_prompt_tokens,
                          use_tqdm, "Processed prompts")

    def embed(
        self,
        prompts: PromptType | Seq[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`, a list of floats), in input order."""
        outs = self._pool(prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm,
                          "Processed prompts")
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def score(
        self,
        data_1: PromptType | Seq[PromptType],
        data_2: PromptType | Seq[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """A score for each pair: `data_1` one text against every text of `data_2`, or the two
        lists pairwise (equal lengths). An embedding model scores the cosine similarity of the
        two embeddings; a one-label classifier (a cross-encoder / reranker) the probability of
        the pair encoded together (`tokenizer(text_1, text_pair=text_2)`)."""
        first = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        second = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        if not first or not second:
            raise ValueError("score: data_1 and data_2 must not be empty")
        if len(first) != len(second) and len(first) != 1:
            raise ValueError(f"score: data_1 has {len(first)} elements and data_2 "
                             f"{len(second)}: give one data_1 or as many as data_2")
        if head_kind(self.engine.model_config) == "classifier":
            return self._cross_encode(first * (len(second) // len(first)), second,
                                      pooling_params, truncate_prompt_tokens, use_tqdm)
        # NOTE: a single data_1 is embedded once (as vLLM: usage counts it once).
        embs = self._pool(first + second, pooling_params, "embed", truncate_prompt_tokens,
                          use_tqdm, "Scored pairs")
        n = len(first)
        lefts = embs[:n] * (len(second) // n)
        outs = []
        for a, b in zip(lefts, embs[n:]):
            score = torch.nn.functional.cosine_similarity(a.outputs.data, b.outputs.data, dim=0)
            outs.append(ScoringRequestOutput(f"{a.request_id}_{b.request_id}",
                                             ScoringOutput(float(score)),
                                             a.prompt_token_ids + b.prompt_token_ids))
        return outs

    def classify(
        self,
        prompts: PromptType | Seq[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (`.outputs.probs`) from a `*ForSequenceClassification`
        checkpoint's head over the last token; ValueError naming the missing head otherwise."""
        outs = self._pool(prompts, pooling_params, "classify", truncate_prompt_tokens,
                          use_tqdm, "Classified prompts")
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def _cross_encode(self, first, second, pooling_params, truncate, use_tqdm):
        engine = self.engine
        if int(engine.model_config.num_labels) != 1:
            raise ValueError(f"score: a classifier scores pairs only with one label (a "
                             f"cross-encoder); this one has {engine.model_config.num_labels}")
        pairs = []
        for i, (a, b) in enumerate(zip(first, second)):
            if not (isinstance(a, str) and isinstance(b, str)):
                raise ValueError(f"score: pair {i}: a cross-encoder scores text pairs (strings)")
            if engine.tokenizer is None:
                raise ValueError("score: cross-encoding needs a tokenizer")
            pairs.append({"prompt_token_ids": list(engine.tokenizer(a, text_pair=b).input_ids)})
        outs = self._pool(pairs, pooling_params, "classify", truncate, use_tqdm, "Scored pairs")
        return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])),
                                     o.prompt_token_ids) for o in outs]

    # --- shared ---------------------------------------------------------------------------------

    def _pool(self, prompts, pooling_params, task: str, truncate: int | None, use_tqdm: bool,
              desc: str) -> list[PoolingRequestOutput]:
        engine = self.engine
        from pagedserve.inputs import prompt_list

        prompts = prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams()
        if isinstance(pooling_params, PoolingParams):
            params = [pooling_params] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"pooling_params: got {len(params)} for {len(prompts)} prompts")
        for i, p in enumerate(params):
            check_runner(engine.runner, p)
            if p.task is not None and p.task != task:
                raise ValueError(f"pooling_params[{i}].task={p.task!r} differs from the task "
                                 f"{task!r}")
            if p.task is None:
                params[i] = p = p.clone()
                p.task = task
        parsed = []
        for i, prompt in enumerate(prompts):  # validate all before adding any
            text, ids = self._parse_prompt(prompt, i)
            ids = engine.tokenize(text) if ids is None else ids
            ids = engine._validate_prompt(_truncate(ids, truncate, engine.max_model_len))
            engine._validate_pooling(len(ids))
            parsed.append((text, ids))
        for p in params:
            pooling_spec(p, engine.pooler_config, engine.model_config, engine.source.name,
                         hidden_size(engine.model_config))
        order: dict[str, int] = {}
        for i, ((text, ids), p) in enumerate(zip(parsed, params)):
            request_id = engine.new_request_id()
            order[request_id] = i
            engine.add_request(request_id, text, p, prompt_token_ids=ids)
        return self._run(order, desc, use_tqdm)


def _truncate(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The last `keep` tokens (-1: `max_model_len`), as vLLM's `truncate_prompt_tokens`."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or at least 1, got {keep!r}")
    return ids[-keep:] if len(ids) > keep else ids
