"""POST /tokenize and /detokenize (vLLM's extra endpoints)."""

from __future__ import annotations

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization:
    """Tokenize a prompt or a conversation (rendered as chat completions would) and back."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.tokenizer = chat.tokenizer

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError("give exactly one of prompt and messages", 400, "prompt")
        if request.messages is not None:
            add_special = bool(request.add_special_tokens)  # default False for chat
            ids = self.chat.render(
                request.messages, chat_template=request.chat_template,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                template_kwargs=request.chat_template_kwargs, add_special_tokens=add_special,
            ).token_ids
        else:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            ids = self.chat.tokenize(request.prompt, add_special)
        return TokenizeResponse(
            count=len(ids), max_model_len=self.chat.max_model_len, tokens=ids,
            token_strs=self.tokenizer.convert_ids_to_tokens(ids)
            if request.return_token_strs else None,
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.chat.check_model(request.model)
        vocab = self.chat.vocab_size
        for t in request.tokens:
            if not 0 <= t < vocab:
                raise APIError(f"tokens: token id {t} is outside the vocabulary [0, {vocab})",
                               400, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
