"""Pydantic models of OpenAI's Responses API (`/v1/responses`) as vLLM serves it: the request,
the response object (also what the stream's lifecycle events carry), its output items
(reasoning, message, function call) and usage. Field names and shapes are OpenAI's
(`openai.types.responses`); the stream events themselves are built in serving_responses.py."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedserve.entrypoints.openai.protocol import OpenAIBaseModel


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(OpenAIBaseModel):
    """POST /v1/responses. vLLM's extra sampling fields (`top_k`, `seed`, `logit_bias`,
    `structured_outputs`, `chat_template_kwargs`, ...) pass through to the chat request it
    becomes; other unknown fields are ignored with a warning."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    # OpenAI's default; without --enable-responses-api-store it is ignored (as vLLM does)
    store: bool | None = True
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    background: bool | None = False
    truncation: str | None = "disabled"
    reasoning: dict[str, Any] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(BaseModel):
    id: str = Field(default_factory=lambda: item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: str = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningItem(BaseModel):
    id: str = Field(default_factory=lambda: item_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: str = "completed"


class FunctionCallItem(BaseModel):
    id: str = Field(default_factory=lambda: item_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str = Field(default_factory=lambda: item_id("call"))
    name: str
    arguments: str
    status: str = "completed"


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)


class IncompleteDetails(BaseModel):
    reason: str


class ResponseObject(BaseModel):
    """The response (`object: "response"`), also each lifecycle event's `response`."""

    id: str = Field(default_factory=lambda: item_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: str = "completed"  # in_progress | completed | incomplete
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: Any = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    store: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    background: bool = False
    truncation: str = "disabled"
    reasoning: dict[str, Any] | None = None

