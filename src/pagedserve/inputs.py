"""vLLM's prompt types (`vllm.inputs`): what `LLM.generate` and friends take besides a string.

`TextPrompt` and `TokensPrompt` are plain dicts (TypedDicts, as vLLM's): `{"prompt": str}` and
`{"prompt_token_ids": [int, ...]}`; a bare list of token ids is a prompt too."""

from __future__ import annotations

from typing import NotRequired, TypedDict



class TextPrompt(TypedDict):
    """A prompt given as text (tokenized by the engine)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt given as token ids; `prompt`, when given, is its text (shown in outputs)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt | list[int]
"""One prompt: text, a TextPrompt, a TokensPrompt or a bare list of token ids."""


def prompt_list(prompts) -> list:
    """One prompt (text, a dict, a bare list of token ids) or a sequence of them, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one bare list of token ids
    return prompts
