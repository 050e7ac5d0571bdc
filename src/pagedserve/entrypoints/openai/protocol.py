"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks, errors.

Field names and defaults follow OpenAI's API, plus vLLM's extra sampling fields. Request models
accept unknown fields (`extra="allow"`): the server ignores them with a logged warning, as vLLM
does, so clients that send extras keep working. Known OpenAI fields whose feature the engine lacks
are listed in `UNSUPPORTED_FIELDS` and refused with a 400 by the serving layer.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    """Accepts unknown fields; `ignored_fields()` lists them."""

    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


# --- errors ------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# --- shared ------------------------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    # vLLM's extra: usage on every chunk.
    continuous_usage_stats: bool | None = False


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details: prompt tokens found in the prefix cache.
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class SamplingFields(OpenAIBaseModel):
    """Sampling fields common to completions and chat (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    best_of: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    # vLLM's beam search: `n` is the beam width (runs inside the engine, see core/beam_search.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's request extras (serving_engine.py applies them)
    return_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None
    # vLLM's request priority (lower first): needs --scheduling-policy priority unless 0
    priority: int = 0
    # Structured outputs (read by entrypoints/openai/structured.py, which checks them)
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


# --- completions -------------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    # vLLM's extra
    add_special_tokens: bool = True


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extra: per prompt position {token id: {logprob, rank, decoded_token}}, first None.
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None
    # vLLM's extras with return_token_ids
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on a choice's first chunk
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new tokens


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# --- chat --------------------------------------------------------------------------------------


class ChatMessage(OpenAIBaseModel):
    """One input message; `content` is a string, a list of content parts, or null. Any role is
    accepted and passed to the chat template (as vLLM does: templates may know custom roles)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # vLLM's extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (read by entrypoints/openai/tool_calls.py, which checks them)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's extra: with --reasoning-parser, false leaves the reasoning out of the answer
    include_reasoning: bool = True


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """One tool call's piece in a stream chunk (OpenAI's shape: `index`, then on the first piece
    `id`, `type` and `function.name`, and `function.arguments` text to append)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


def _drop_none_reasoning(data: dict[str, Any]) -> dict[str, Any]:
    for key in REASONING_FIELDS:
        if data.get(key) is None:
            data.pop(key, None)
    return data


# With --reasoning-parser: the reasoning text, under vLLM's name and its older one.
REASONING_FIELDS = ("reasoning", "reasoning_content")


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[Any] = Field(default_factory=list)
    reasoning: str | None = None  # left out when None
    reasoning_content: str | None = None  # left out when None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return _drop_none_reasoning(handler(self))


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaMessage(BaseModel):
    """A chat stream delta; fields left None are left out of the JSON (`{}` on the last chunk)."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new tokens


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk


# --- models, tokenizer, version ---------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(OpenAIBaseModel):
    """POST /tokenize: either `prompt` (completion style) or `messages` (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


# Known fields (OpenAI's, and vLLM's extras) whose feature this engine lacks: a request that sets
# one to a meaningful value gets a 400 instead of a silently different answer. Maps the field to
# a predicate "is it in use" on its raw JSON value.
def _set(value: Any) -> bool:
    return value is not None and value is not False and value not in ([], {}, "")


def _not_text_modalities(value: Any) -> bool:
    return _set(value) and value != ["text"]


def _tool_choice(value: Any) -> bool:
    return _set(value) and value not in ("none", "auto")


UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "suffix": (_set, "suffix (insertion) is not supported by this server"),
    "functions": (_set, "function calling is not supported by this server"),
    "function_call": (_tool_choice, "function calling is not supported by this server"),
    "audio": (_set, "audio output is not supported by this server"),
    "modalities": (_not_text_modalities, "only the 'text' modality is supported"),
    "prediction": (_set, "predicted outputs are not supported by this server"),
    "web_search_options": (_set, "web search is not supported by this server"),
    "logits_processors": (_set, "logits processors are not supported by this server"),
}
