"""What every reasoning parser offers: where a model's thinking ends, on token ids (the engine:
structured outputs apply only after it) and on text (the server: the message's `reasoning`
apart from its `content`, whole or streamed).

The common shape is a span between a START marker and an END marker (``<think>`` ...
``</think>``); a parser names its markers (each may have spellings, `START` / `END` tuples), and
a few switches:

- START_REQUIRED: an output that does not open with START is all content (Mistral's
  ``[THINK]``, Granite's "Here is my thought process:"); otherwise the text before END is the
  reasoning whether or not START was written (the template may have put it in the prompt), and
  an output without END is all reasoning (cut short while thinking).
- THINKING_SWITCH / THINKING_DEFAULT: `chat_template_kwargs` ``enable_thinking`` / ``thinking``
  false turns thinking off (the output is all content); true turns it on; a parser whose
  model thinks only when asked (deepseek_v3) has THINKING_DEFAULT False.
- WRAP: (open, close) around the content after the reasoning (``<answer>`` ... ``</answer>``),
  dropped from it.

Markers are text; the engine knows them as token-id sequences (`make` reads them from the
tokenizer: a single token where the vocabulary has the marker, else its encoding). Parsers with
SINGLE_TOKENS (the think tags) refuse a tokenizer without them, as vLLM does.

NOTE: text split rules are written so that each part only grows while the output does
(`split(..., finished=False)` leaves out what might still turn into a marker); the streamed
deltas (`ReasoningStream`) are the differences, so they always add up to the whole text's split.
A START that opens the output (after whitespace) is dropped; vLLM drops whatever precedes the
first START anywhere, here only a leading one is, so that streamed text never has to be taken
back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

IdSeqs = tuple[tuple[int, ...], ...]


def prefix_at_end(text: str, marker: str) -> int | None:
    """The earliest index from which the end of `text` is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return None


def _hold_back(text: str, markers: Sequence[str]) -> str:
    """`text` without an end that may still become one of `markers`."""
    cuts = [c for c in (prefix_at_end(text, m) for m in markers) if c is not None]
    return text[: min(cuts)] if cuts else text


def _id_seqs(value: Any) -> IdSeqs:
    """An id, a sequence of ids, or several sequences, as a tuple of id sequences."""
    if value is None:
        return ()
    if isinstance(value, int):
        return ((value,),)
    value = list(value)
    if value and all(isinstance(v, int) for v in value):
        return (tuple(value),)
    return tuple(tuple(v) for v in value)


def _ends_with(ids: Sequence[int], seq: tuple[int, ...]) -> bool:
    n = len(seq)
    return 0 < n <= len(ids) and tuple(ids[len(ids) - n:]) == seq


class ReasoningParser:
    """Base and the ``<think>`` ... ``</think>`` parser (deepseek_r1's rules); `start` / `end`:
    the markers' token ids (an id, a sequence of ids, or several sequences: `make` reads them
    from a tokenizer)."""

    name = "deepseek_r1"
    START: tuple[str, ...] = ("<think>",)
    END: tuple[str, ...] = ("</think>",)
    START_REQUIRED = False
    THINKING_SWITCH = False
    THINKING_DEFAULT = True
    WRAP: tuple[str, str] | None = None
    SINGLE_TOKENS = True  # the markers must be single tokens of the vocabulary
    # False when the markers are special tokens the detokenizer would leave out of the text:
    # requests then keep them (as vLLM's `adjust_request` does).
    skip_special_tokens = True

    def __init__(self, start: Any = None, end: Any = None) -> None:
        self.start_ids: IdSeqs = _id_seqs(start)
        self.end_ids: IdSeqs = _id_seqs(end)

    @property
    def start_token_id(self) -> int | None:
        """The START marker's id where it is one token."""
        return self.start_ids[0][0] if self.start_ids and len(self.start_ids[0]) == 1 else None

    @property
    def end_token_id(self) -> int | None:
        """The END marker's id where it is one token."""
        return self.end_ids[0][0] if self.end_ids and len(self.end_ids[0]) == 1 else None

    @classmethod
    def make(cls, tokenizer) -> ReasoningParser:
        """This parser for `tokenizer`: its markers' ids (ValueError naming `reasoning_parser`
        when SINGLE_TOKENS markers are not single tokens of the vocabulary)."""
        vocab = tokenizer.get_vocab()
        missing = [m for m in (*cls.START, *cls.END) if m not in vocab]
        if cls.SINGLE_TOKENS and missing:
            raise ValueError(f"reasoning_parser {cls.name!r}: the tokenizer has no "
                             f"{' or '.join(missing)} token (the parser reads its tags as "
                             "single tokens)")

        def ids(markers: tuple[str, ...]) -> list[tuple[int, ...]]:
            return [(vocab[m],) if m in vocab else
                    tuple(tokenizer.encode(m, add_special_tokens=False)) for m in markers]

        return cls(ids(cls.START), ids(cls.END))

    # --- token ids (the engine) ---------------------------------------------------------------

    def _last_tag(self, token_ids: Sequence[int]) -> str | None:
        """"start" / "end": which marker occurs last in `token_ids` (None: neither)."""
        starts = {s[-1] for s in self.start_ids}
        ends = {s[-1] for s in self.end_ids}
        for i in range(len(token_ids) - 1, -1, -1):
            t = token_ids[i]
            if t in starts and any(_ends_with(token_ids[: i + 1], s) for s in self.start_ids):
                return "start"
            if t in ends and any(_ends_with(token_ids[: i + 1], s) for s in self.end_ids):
                return "end"
        return None

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the reasoning has ended in `token_ids` (a prompt, with or without output):
        END is the last marker in them; with neither marker, whether the model starts without
        thinking (START_REQUIRED, or not THINKING_DEFAULT)."""
        last = self._last_tag(token_ids)
        if last is None:
            return self.START_REQUIRED or not self.THINKING_DEFAULT
        return last == "end"

    def ends_reasoning(self, token: int, token_ids: Sequence[int] = ()) -> bool:
        """Whether `token`, generated while reasoning, ends it; `token_ids`: the sequence's ids
        up to and including `token` (needed for markers of several tokens)."""
        for seq in self.end_ids:
            if len(seq) == 1 and token == seq[0]:
                return True
            if len(seq) > 1 and token == seq[-1] and _ends_with(token_ids, seq):
                return True
        return False

    def reasoning_tokens(self, output_ids: Sequence[int], has_reasoning: bool) -> int:
        """How many of an output's tokens are reasoning (up to and excluding the END marker)."""
        if not has_reasoning:
            return 0
        ids = list(output_ids)
        for i in range(len(ids)):
            for seq in self.end_ids:
                if _ends_with(ids[: i + 1], seq):
                    return i + 1 - len(seq)
        return len(ids)

    # --- text (the server) --------------------------------------------------------------------

    def thinking(self, template_kwargs: dict[str, Any] | None) -> bool:
        """Whether a request thinks: with THINKING_SWITCH, ``enable_thinking`` / ``thinking``
        false turns it off and true on; THINKING_DEFAULT otherwise."""
        if not self.THINKING_SWITCH:
            return self.THINKING_DEFAULT
        values = [(template_kwargs or {}).get(k) for k in ("enable_thinking", "thinking")]
        if any(v is False for v in values):
            return False
        return True if any(v is True for v in values) else self.THINKING_DEFAULT

    def split(self, text: str, *, thinking: bool = True, prompt_ended: bool = False,
              finished: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of an output's text; None for a part that is absent. While
        unfinished, what might still turn into a marker (its beginning at the end) is left out
        of both, so each part only ever grows."""
        if prompt_ended or not thinking:
            return None, text
        stripped = text.lstrip()
        start = next((s for s in self.START if stripped.startswith(s)), None)
        if start is not None:
            body = stripped[len(start):]
        elif not finished and any(s.startswith(stripped) for s in self.START):
            return None, None  # nothing yet, or the beginning of a leading START
        elif self.START_REQUIRED:
            return None, text
        else:
            body = text
        found = [(i, m) for i, m in ((body.find(m), m) for m in self.END) if i >= 0]
        if found:
            i, marker = min(found)
            content = self.content(body[i + len(marker):], finished)
            return body[:i], content or None
        if not finished:
            body = _hold_back(body, self.END)
        return body, None

    def content(self, rest: str, finished: bool) -> str:
        """The content in the text after the reasoning: inside WRAP where it opens with it."""
        if self.WRAP is None:
            return rest
        opening, closing = self.WRAP
        stripped = rest.lstrip()
        if stripped.startswith(opening):
            inner = stripped[len(opening):]
            j = inner.find(closing)
            if j >= 0:
                return inner[:j]
            return inner if finished else _hold_back(inner, (closing,))
        if not finished and opening.startswith(stripped):
            return ""
        return rest

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
