"""The pooling routes (vLLM's, for a server started with `--runner pooling`): POST /v1/embeddings
(OpenAI's), /pooling, /classify (a `*ForSequenceClassification` checkpoint), /score and /v1/score
(cosine similarity of embeddings; a one-label classifier scores the pair encoded together),
/rerank, /v1/rerank and /v2/rerank (Jina / Cohere style). On a generate server they answer 400 naming the
runner; generation routes on a pooling server answer 400 the same way (the engine's check).

Inputs: a string, a list of strings, a list of token ids, or a list of token-id lists; or (for
/v1/embeddings and /pooling) one conversation in `messages`, rendered with the chat template
(vLLM's chat embeddings: no generation prompt, no extra special tokens by default). Outputs:
`encoding_format` "float" (lists) or "base64" (little-endian float32 bytes, as the official
`openai` client decodes them). `dimensions` (embeddings) only for Matryoshka models (the
model's config has `is_matryoshka` or `matryoshka_dimensions`), as vLLM.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.offload import json_response
from pagedserve.engine.chat_template import flatten_content, render_chat
from pagedserve.entrypoints.openai.protocol import ChatMessage, OpenAIBaseModel, random_id
from pagedserve.entrypoints.openai.request_io import parse_body, respond
from pagedserve.entrypoints.openai.serving_engine import OpenAIServing, Prompt
from pagedserve.entrypoints.openai.streaming import final_output
from pagedserve.models.base import head_kind
from pagedserve.pooling_params import PoolingParams

# --- requests ------------------------------------------------------------------------------------


class _PoolingFields(OpenAIBaseModel):
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    encoding_format: Literal["float", "base64"] = "float"
    normalize: bool | None = None
    use_activation: bool | None = None
    user: str | None = None


class _ChatInput(_PoolingFields):
    """`input`, or one conversation in `messages` (vLLM's chat form of the pooling requests)."""

    input: Any = None
    messages: list[ChatMessage] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # default: True for input, False for messages


class EmbeddingRequest(_ChatInput):
    dimensions: int | None = None


class PoolingRequest(_ChatInput):
    task: Literal["embed", "token_embed", "classify"] | None = None
    dimensions: int | None = None


class ClassifyRequest(_PoolingFields):
    input: Any


class ScoreRequest(_PoolingFields):
    # vLLM's spellings of the two sides: text_1 / text_2, queries / documents, data_1 / data_2
    text_1: Any = None
    text_2: Any = None
    queries: Any = None
    documents: Any = None
    data_1: Any = None
    data_2: Any = None


class RerankRequest(_PoolingFields):
    query: Any
    documents: Any
    top_n: int = Field(default=0, ge=0)


# --- responses -----------------------------------------------------------------------------------


class PoolingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


class EmbeddingData(BaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(BaseModel):
    index: int
    object: str = "pooling"
    data: list[list[float]] | list[float] | str


class PoolingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str | None = None


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


# --- the handler ---------------------------------------------------------------------------------


def encode_base64(data) -> str:
    """A float32 tensor's values as base64 of their little-endian bytes (vLLM's default)."""
    return base64.b64encode(data.contiguous().numpy().astype("<f4").tobytes()).decode("ascii")


class OpenAIServingPooling(OpenAIServing):
    """Embeddings, pooling, scores and reranking over the async engine."""

    request_fields = frozenset({"input", "dimensions", "task", "text_1", "text_2", "query",
                                "documents", "truncate_prompt_tokens", "encoding_format"})

    def _check(self, request: _PoolingFields, route: str) -> None:
        runner = self.engine.engine.runner
        if runner != "pooling":
            raise APIError(f"{route} needs the pooling runner: this server runs "
                           f"--runner {runner} (start it with --runner pooling)", 400)
        self.check_model(request.model, allow_lora=False)

    def _prompts(self, value: Any, param: str, add_special_tokens: bool,
                 truncate: int | None) -> list[Prompt]:
        """The prompts of an input: a string, a list of strings, token ids or lists of them."""
        if isinstance(value, str):
            items: list[Any] = [value]
        elif isinstance(value, list) and value and all(
                isinstance(t, int) and not isinstance(t, bool) for t in value):
            items = [value]
        elif isinstance(value, list):
            items = value
        else:
            raise APIError(f"{param} must be a string, a list of strings, a list of token ids "
                           "or a list of token-id lists", 400, param)
        if not items:
            raise APIError(f"{param} must not be empty", 400, param)
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = self.tokenize(item, add_special_tokens) if item else []
                prompt = Prompt(ids, item)
            elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in item):
                prompt = Prompt(list(item), None)
            else:
                raise APIError(f"{param} must be a string, a list of strings, a list of token "
                               "ids or a list of token-id lists", 400, param)
            if not prompt.token_ids:
                raise APIError(f"{param} must not be empty (an empty text or token list)", 400,
                               param)
            if truncate is not None:
                keep = self.max_model_len if truncate == -1 else truncate
                if keep < 1 or keep > self.max_model_len:
                    raise APIError("truncate_prompt_tokens must be -1 or in [1, max_model_len "
                                   f"({self.max_model_len})], got {truncate}", 400,
                                   "truncate_prompt_tokens")
                if len(prompt.token_ids) > keep:
                    prompt = Prompt(prompt.token_ids[-keep:], None)
            self.check_token_ids(prompt.token_ids, param)
            if len(prompt.token_ids) > self.max_model_len:
                raise APIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {len(prompt.token_ids)} tokens in the input for "
                    "embedding generation. Please reduce the length of the input.", 400, param)
            prompts.append(prompt)
        return prompts

    async def _pool(self, prompts: list[Prompt], params: PoolingParams, prefix: str,
                    param: str) -> list:
        streams = await self.submit(random_id(prefix), prompts, [params] * len(prompts),
                                    prompt_param=param)
        try:
            return list(await asyncio.gather(*(final_output(s) for s in streams)))
        except BaseException as e:
            for s in streams:
                s.close()
            raise self.engine_error(e, param) from e

    def _params(self, request: _PoolingFields, task: str | None,
                dimensions: int | None) -> PoolingParams:
        try:
            return PoolingParams(task=task, dimensions=dimensions, normalize=request.normalize,
                                 use_activation=request.use_activation)
        except ValueError as e:
            raise APIError(str(e), 400, str(e).split(" ")[0]) from e

    @staticmethod
    def _usage(outs: list) -> PoolingUsage:
        n = sum(len(o.prompt_token_ids) for o in outs)
        return PoolingUsage(prompt_tokens=n, total_tokens=n)

    def _chat_or_input(self, request: _ChatInput) -> list[Prompt]:
        """The prompts of `input`, or the one rendered conversation of `messages`."""
        if (request.input is None) == (request.messages is None):
            raise APIError("give either input or messages", 400, "input")
        if request.messages is None:
            special = True if request.add_special_tokens is None else request.add_special_tokens
            return self._prompts(request.input, "input", special, request.truncate_prompt_tokens)
        try:
            dicts = [{**m.model_dump(exclude_none=True), "content": flatten_content(m.content, i)}
                     for i, m in enumerate(request.messages)]
            text = render_chat(self.tokenizer, dicts, self.chat_format,
                               chat_template=request.chat_template,
                               add_generation_prompt=request.add_generation_prompt,
                               continue_final_message=request.continue_final_message,
                               template_kwargs=request.chat_template_kwargs)
        except ValueError as e:
            raise APIError(str(e), 400, "messages") from e
        ids = self.tokenize(text, bool(request.add_special_tokens))
        return self._prompts([ids], "messages", False, request.truncate_prompt_tokens)

    async def embeddings(self, request: EmbeddingRequest):
        self._check(request, "/v1/embeddings")
        params = self._params(request, "embed", request.dimensions)
        prompts = await self.run_cpu(self._chat_or_input, request)
        outs = await self._pool(prompts, params, "embd", "input")
        fmt = encode_base64 if request.encoding_format == "base64" else (lambda d: d.tolist())
        return await self.run_cpu(lambda: json_response(EmbeddingResponse(
            id=random_id("embd"), model=self.model_name,
            data=[EmbeddingData(index=i, embedding=fmt(o.outputs.data))
                  for i, o in enumerate(outs)],
            usage=self._usage(outs))))

    async def pooling(self, request: PoolingRequest):
        self._check(request, "/pooling")
        if request.dimensions is not None:
            raise APIError("dimensions is currently not supported", 400, "dimensions")
        params = self._params(request, request.task, None)  # None: the model's default task
        prompts = await self.run_cpu(self._chat_or_input, request)
        outs = await self._pool(prompts, params, "pool", "input")
        fmt = encode_base64 if request.encoding_format == "base64" else (lambda d: d.tolist())
        return await self.run_cpu(lambda: json_response(PoolingResponse(
            id=random_id("pool"), model=self.model_name,
            data=[PoolingData(index=i, data=fmt(o.outputs.data)) for i, o in enumerate(outs)],
            usage=self._usage(outs))))

    async def classify(self, request: ClassifyRequest):
        self._check(request, "/classify")
        params = self._params(request, "classify", None)
        prompts = await self.run_cpu(self._prompts, request.input, "input",
                                     request.add_special_tokens, request.truncate_prompt_tokens)
        outs = await self._pool(prompts, params, "classify", "input")
        labels = getattr(self.engine.engine.model_config, "id2label", None) or {}

        def item(i, out):
            probs = out.outputs.data.tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            return ClassificationData(index=i, label=labels.get(best, labels.get(str(best))),
                                      probs=probs, num_classes=len(probs))

        return json_response(ClassificationResponse(
            id=random_id("classify"), model=self.model_name,
            data=[item(i, o) for i, o in enumerate(outs)], usage=self._usage(outs)))

    async def _scores(self, request: _PoolingFields, first: Any, second: Any,
                      names: tuple[str, str]) -> tuple[list[float], list]:
        """Each (first, second) pair's score: the cosine similarity of their embeddings, or a
        one-label classifier's probability of the pair encoded together; the engine outputs."""
        import torch

        config = self.engine.engine.model_config
        cross = head_kind(config) == "classifier"
        if cross and int(config.num_labels) != 1:
            raise APIError("a classifier scores pairs only with one label (a cross-encoder); "
                           f"this one has {config.num_labels}", 400)
        params = self._params(request, "classify" if cross else "embed", None)

        def prepare():
            a = self._prompts(first, names[0], request.add_special_tokens,
                              request.truncate_prompt_tokens)
            b = self._prompts(second, names[1], request.add_special_tokens,
                              request.truncate_prompt_tokens)
            if len(a) != len(b) and len(a) != 1:
                raise APIError(f"{names[0]} has {len(a)} elements and {names[1]} {len(b)}: "
                               f"give one {names[0]} or as many as {names[1]}", 400, names[0])
            return a, b

        a, b = await self.run_cpu(prepare)
        if cross:
            def pair(x: Prompt, y: Prompt) -> Prompt:
                if x.text is None or y.text is None:
                    raise APIError("a cross-encoder scores text pairs (strings)", 400, names[0])
                ids = list(self.tokenizer(x.text, text_pair=y.text).input_ids)
                if len(ids) > self.max_model_len:
                    raise APIError(f"a pair is {len(ids)} tokens long, more than the model's "
                                   f"context length ({self.max_model_len})", 400, names[1])
                return Prompt(ids, None)

            pairs = await self.run_cpu(
                lambda: [pair(x, y) for x, y in zip(a * (len(b) // len(a)), b)])
            outs = await self._pool(pairs, params, "score", names[0])
            return [float(o.outputs.data[0]) for o in outs], outs
        # NOTE: a single first text is embedded once (as vLLM: usage counts it once).
        outs = await self._pool(a + b, params, "score", names[0])
        n = len(a)
        scores = [float(torch.nn.functional.cosine_similarity(x.outputs.data, y.outputs.data,
                                                              dim=0))
                  for x, y in zip(outs[:n] * (len(b) // n), outs[n:])]
        return scores, outs

    async def score(self, request: ScoreRequest):
        self._check(request, "/score")
        for names in (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2")):
            first, second = getattr(request, names[0]), getattr(request, names[1])
            if first is not None and second is not None:
                break
        else:
            raise APIError("a score request needs text_1 and text_2 (or queries and documents, "
                           "or data_1 and data_2)", 400, "text_1")
        scores, outs = await self._scores(request, first, second, names)
        return json_response(ScoreResponse(
            id=random_id("score"), model=self.model_name,
            data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
            usage=self._usage(outs)))

    async def rerank(self, request: RerankRequest):
        self._check(request, "/rerank")
        if not isinstance(request.query, str):
            raise APIError("query must be a string", 400, "query")
        docs = [request.documents] if isinstance(request.documents, str) else request.documents
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
            raise APIError("documents must be a non-empty list of strings", 400, "documents")
        scores, outs = await self._scores(request, request.query, docs, ("query", "documents"))
        order = sorted(range(len(docs)), key=lambda i: scores[i], reverse=True)
        if request.top_n:
            order = order[: request.top_n]
        usage = self._usage(outs)
        return json_response(RerankResponse(
            id=random_id("rerank"), model=self.model_name,
            usage=RerankUsage(prompt_tokens=usage.prompt_tokens, total_tokens=usage.total_tokens),
            results=[RerankResult(index=i, document=RerankDocument(text=docs[i]),
                                  relevance_score=scores[i]) for i in order]))


def add_pooling_routes(app: FastAPI, engine, settings, pool) -> None:
    """Register the routes of the module docstring on `app`."""
    serving = OpenAIServingPooling(engine, settings, pool)
    routes = [
        (("/v1/embeddings",), EmbeddingRequest, serving.embeddings),
        (("/pooling",), PoolingRequest, serving.pooling),
        (("/classify",), ClassifyRequest, serving.classify),
        (("/score", "/v1/score"), ScoreRequest, serving.score),
        (("/rerank", "/v1/rerank", "/v2/rerank"), RerankRequest, serving.rerank),
    ]
    def endpoint(model, handler):
        async def route(raw: Request):
            request = await parse_body(raw, model, pool)
            return await respond(raw, handler(request))
        return route

    for paths, model, handler in routes:
        for path in paths:
            app.add_api_route(path, endpoint(model, handler), methods=["POST"])
