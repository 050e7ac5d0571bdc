"""Reasoning parsers (`--reasoning-parser`): where a model's thinking ends in its output, as
vLLM's parsers of the same names read it. The engine uses `is_reasoning_end` / `ends_reasoning`
(token ids) so that structured outputs apply only after the reasoning; the server uses `split`
(text) and `ReasoningStream` (streamed text) to put the reasoning in the message's `reasoning`
field and the rest in `content`.

Both parsers know ``<think>`` ... ``</think>`` (which must be single tokens of the tokenizer):

- ``deepseek_r1``: the text before ``</think>`` is the reasoning, with or without a ``<think>``
  (DeepSeek-R1's template puts ``<think>`` in the prompt); an output without ``</think>`` is all
  reasoning (it was cut short while thinking).
- ``qwen3``: as vLLM's current Qwen3 parser (Qwen3 and Qwen3.5 templates: ``<think>`` may be in
  the prompt or in the output): the same split, except that with thinking switched off
  (`chat_template_kwargs` ``enable_thinking: false``, or ``thinking: false``) the output is all
  content. (vLLM's parser before Qwen3.5 required both tags in the output; the current one does
  not.)

With either parser, an output whose prompt already ended the reasoning (the last think tag in
the prompt is ``</think>``, as Qwen3's template writes ``<think>\\n\\n</think>`` with thinking
off) is all content, as vLLM's serving layer does (`prompt_is_reasoning_end`).

A ``<think>`` that opens the output (after whitespace) is dropped. NOTE: vLLM drops whatever
precedes the first ``<think>`` anywhere; here only a leading one is, so that streamed text never
has to be taken back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def _prefix_at_end(text: str, marker: str) -> int | None:
    """The earliest index from which the end of `text` is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return None


@dataclass(frozen=True)
class ReasoningParser:
    """One parser, bound to a tokenizer's think-tag ids."""

    name: str
    start_token_id: int
    end_token_id: int

    # --- token ids (the engine) ---------------------------------------------------------------

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the reasoning has ended in `token_ids` (prompt and/or output): the last think
        tag among them is ``</think>``."""
        for t in reversed(token_ids):
            if t == self.start_token_id:
                return False
            if t == self.end_token_id:
                return True
        return False

    def ends_reasoning(self, token: int) -> bool:
        """Whether `token`, generated while reasoning, ends it."""
        return token == self.end_token_id

    def reasoning_tokens(self, output_ids: Sequence[int], has_reasoning: bool) -> int:
        """How many of an output's tokens are reasoning (up to and excluding ``</think>``)."""
        if not has_reasoning:
            return 0
        ids = list(output_ids)
        return ids.index(self.end_token_id) if self.end_token_id in ids else len(ids)

    # --- text (the server) --------------------------------------------------------------------

    def thinking(self, template_kwargs: dict[str, Any] | None) -> bool:
        """Whether a request leaves thinking on (qwen3's switch; deepseek_r1 has none)."""
        if self.name != "qwen3" or not template_kwargs:
            return True
        return template_kwargs.get("enable_thinking", True) is not False and \
            template_kwargs.get("thinking", True) is not False

    def split(self, text: str, *, thinking: bool = True, prompt_ended: bool = False,
              finished: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of an output's text; None for a part that is absent. While
        unfinished, what might still turn into a tag (its beginning at the end) is left out of
        both, so each part only ever grows."""
        if prompt_ended or not thinking:
            return None, text
        stripped = text.lstrip()
        if stripped.startswith(START):
            body = stripped[len(START):]
        elif not finished and START.startswith(stripped):
            return None, None  # nothing yet, or the beginning of a leading <think>
        else:
            body = text
        i = body.find(END)
        if i >= 0:
            return body[:i], body[i + len(END):] or None
        if not finished:
            cut = _prefix_at_end(body, END)
            if cut is not None:
                body = body[:cut]
        return body, None

    def stream(self, *, thinking: bool = True, prompt_ended: bool = False) -> ReasoningStream:
        return ReasoningStream(self, thinking, prompt_ended)


class ReasoningStream:
    """One streamed choice's text deltas turned into (reasoning delta, content delta). NOTE: the
    deltas add up to `ReasoningParser.split` of the whole text (each part is a prefix of its
    final value at every step; see `split`)."""

    def __init__(self, parser: ReasoningParser, thinking: bool, prompt_ended: bool) -> None:
        self.parser = parser
        self.thinking = thinking
        self.prompt_ended = prompt_ended
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self.parser.split(self.text, thinking=self.thinking,
                                               prompt_ended=self.prompt_ended, finished=finished)
        reasoning, content = reasoning or "", content or ""
        out = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return out


def make_reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    """The parser `name` for `tokenizer`. ValueError for an unknown name, or a tokenizer whose
    vocabulary lacks the think tags as single tokens."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {name!r}")
    if tokenizer is None:
        raise ValueError(f"reasoning_parser {name!r} needs a tokenizer (the engine runs with "
                         "skip_tokenizer_init)")
    vocab = tokenizer.get_vocab()
    missing = [tag for tag in (START, END) if tag not in vocab]
    if missing:
        raise ValueError(f"reasoning_parser {name!r}: the tokenizer has no {' or '.join(missing)} "
                         "token (the parser reads the think tags as single tokens)")
    return ReasoningParser(name, vocab[START], vocab[END])


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "make_reasoning_parser"]
