"""Rendering chat messages into a prompt with the tokenizer's chat template: one module below
both of its users, the server's chat routes and the offline `LLM.chat` (engine/llm_extras.py).

Templates are rendered by transformers' `apply_chat_template` (jinja2 in a sandboxed, immutable
environment; a template cannot touch Python objects or files). The rendered text already holds
the special tokens the template writes (BOS, turn markers), so it is tokenized with
`add_special_tokens=False` by default, never adding BOS twice.

A tokenizer without a template gets a documented default:

- Gemma-style vocabularies (with `<start_of_turn>` / `<end_of_turn>` tokens, like the embedded
  Gemma 3 270M GGUF, which carries no template): Gemma's turn format,
  ``<bos><start_of_turn>user\\n{content}<end_of_turn>\\n<start_of_turn>model\\n``; a system
  message is prepended to the first user turn (as Gemma's own template does), and
  `<end_of_turn>` becomes a stop token.
- Any other: ``<bos>User: {content}\\n\\nAssistant: {content}\\n\\n...Assistant:`` (roles
  capitalised, `{bos}` only if the tokenizer has one).

A request may pass its own `chat_template` (jinja2 source), rendered the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GEMMA_TURN_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{%- if messages and messages[0]['role'] in ('system', 'developer') -%}"
    "{%- set first_user_prefix = (messages[0]['content'] or '') + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- if not loop_messages and first_user_prefix -%}"
    "{{ '<start_of_turn>user\n' + first_user_prefix | trim + '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ (message['content'] or '') | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

PLAIN_TEMPLATE = (
    "{{ bos_token if bos_token else '' }}"
    "{%- for message in messages -%}"
    "{{ message['role'] | capitalize + ': ' + (message['content'] or '') + '\n\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)

GEMMA_END_OF_TURN = "<end_of_turn>"
GEMMA_START_OF_TURN = "<start_of_turn>"


@dataclass(frozen=True)
class ChatFormat:
    """How a model's chat prompts are rendered: a template (None: the tokenizer's own) and the
    token ids that end an assistant turn besides the model's EOS."""

    name: str
    template: str | None
    stop_token_ids: list[int] = field(default_factory=list)


def _token_id(tokenizer: Any, token: str) -> int | None:
    ids = tokenizer.convert_tokens_to_ids([token])
    tid = ids[0] if ids else None
    unk = getattr(tokenizer, "unk_token_id", None)
    if tid is None or tid == unk:
        return None
    return int(tid)


def default_chat_format(tokenizer: Any) -> ChatFormat:
    """The tokenizer's own template if it has one, else the documented default (see above)."""
    if getattr(tokenizer, "chat_template", None):
        return ChatFormat("tokenizer", None)
    end = _token_id(tokenizer, GEMMA_END_OF_TURN)
    start = _token_id(tokenizer, GEMMA_START_OF_TURN)
    if end is not None and start is not None:
        return ChatFormat("gemma-default", GEMMA_TURN_TEMPLATE, [end])
    return ChatFormat("plain-default", PLAIN_TEMPLATE)


def flatten_content(content: Any, index: int) -> str:
    """A message's content as text: a string, or the text parts of a content list joined with
    newlines (as vLLM does for text-only models). Other parts are a ValueError."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise ValueError(
                f"messages[{index}].content: content part of type {kind!r} is not supported "
                "(this server serves text-only models)"
            )
    return "\n".join(parts)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_format: ChatFormat,
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text for `messages` (each `{"role", "content", ...}` with string content).

    Raises ValueError for an empty list, a template error or a template that refuses the
    conversation (e.g. a role order it does not allow).
    """
    if not messages:
        raise ValueError("messages must not be empty")
    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be true"
        )
    from jinja2 import TemplateError

    template = chat_template or chat_format.template
    kwargs = dict(template_kwargs or {})
    for reserved in ("conversation", "messages", "tokenize", "chat_template"):
        kwargs.pop(reserved, None)
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tokenize=False, **kwargs,
        )
    except TemplateError as e:
        raise ValueError(f"messages: the chat template failed: {e}") from e
    except (TypeError, KeyError, IndexError) as e:
        raise ValueError(f"messages: the chat template failed: {e!r}") from e
    if not isinstance(text, str):  # a batch was rendered: the input was not a flat list
        raise ValueError("messages: expected a list of message objects")
    return text
