"""``openai_gptoss`` (gpt-oss, OpenAI's harmony format), and the harmony message reader the
``openai`` tool-call parser shares.

A harmony output is a run of messages, each
``[<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]
<|message|>BODY`` ended by ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the first message's
``<|start|>assistant`` is in the prompt; the stop token that ends the output is not in its text).
The markers are special tokens, kept in the text for the parsers (skip_special_tokens false).

- reasoning: the bodies of the ``analysis`` messages that open the output (joined by newlines);
- content: what follows: a ``final`` message or a ``commentary`` preamble gives its body; a
  message to a recipient (a tool call: ``to=functions.NAME``) is kept whole, markers included,
  for the tool-call parser (``--tool-call-parser openai``) to read;
- an output that does not open with a harmony header is all content.

On token ids the reasoning ends with ``<|channel|>final<|message|>``: a prompt has ended it only
when it ends with that (earlier turns' final messages do not count).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pagedserve.reasoning.base import ReasoningParser, _ends_with, _hold_back

HEADER_STARTS = ("<|start|>", "<|channel|>")
MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (*HEADER_STARTS, MESSAGE, *ENDS, "<|constrain|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class HarmonyMessage:
    """One message: its header (markers included, up to ``<|message|>``), body, end marker."""

    __slots__ = ("header", "body", "end")

    def __init__(self, header: str, body: str, end: str) -> None:
        self.header, self.body, self.end = header, body, end

    @property
    def channel(self) -> str | None:
        m = _CHANNEL.search(self.header)
        return m.group(1) if m else None

    @property
    def recipient(self) -> str | None:
        m = _RECIPIENT.search(self.header)
        return m.group(1) if m else None

    def raw(self) -> str:
        return self.header + MESSAGE + self.body + self.end


def _next(text: str, markers: Sequence[str], pos: int) -> tuple[int, str] | None:
    found = [(i, m) for i, m in ((text.find(m, pos), m) for m in markers) if i >= 0]
    return min(found) if found else None


def harmony_messages(text: str, finished: bool = True) -> tuple[str, list[HarmonyMessage]]:
    """(the text before the first header, the messages). While unfinished, a header without its
    ``<|message|>`` yet is left out, and a body's end that may still become a marker is held."""
    first = _next(text, HEADER_STARTS, 0)
    if first is None:
        return (text if finished else _hold_back(text, MARKERS)), []
    lead, pos, messages = text[: first[0]], first[0], []
    while pos < len(text):
        m = text.find(MESSAGE, pos)
        if m < 0:
            break  # a header still being written (or text after the last message)
        header, start = text[pos:m], m + len(MESSAGE)
        stop = _next(text, (*ENDS, *HEADER_STARTS), start)
        if stop is None:
            body = text[start:]
            messages.append(HarmonyMessage(header, body if finished else
                                           _hold_back(body, MARKERS), ""))
            break
        i, marker = stop
        end = marker if marker in ENDS else ""
        messages.append(HarmonyMessage(header, text[start:i], end))
        nxt = _next(text, HEADER_STARTS, i + len(end))
        if nxt is None:
            break
        pos = nxt[0]
    return lead, messages


def is_harmony(text: str) -> bool:
    return text.lstrip().startswith(HEADER_STARTS)


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    START = ("<|channel|>analysis<|message|>",)
    END = ("<|channel|>final<|message|>",)
    SINGLE_TOKENS = False
    skip_special_tokens = False

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        return any(_ends_with(token_ids, seq) for seq in self.end_ids)

    def split(self, text, *, thinking=True, prompt_ended=False, finished=True):
        if prompt_ended or not thinking:
            return None, text
        stripped = text.lstrip()
        if not is_harmony(stripped):
            if not finished and any(h.startswith(stripped) for h in HEADER_STARTS):
                return None, None
            return None, text
        _, messages = harmony_messages(stripped, finished)
        reasoning: list[str] = []
        content = ""
        opening = True
        for msg in messages:
            if opening and msg.channel == "analysis" and msg.recipient is None:
                reasoning.append(msg.body)
                continue
            opening = False
            if msg.recipient is not None:
                content += msg.raw()
            elif msg.channel != "analysis":
                content += msg.body
        return ("\n".join(reasoning) if reasoning else None), (content or None)
