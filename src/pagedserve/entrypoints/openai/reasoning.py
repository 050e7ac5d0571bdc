"""A request's use of the server's reasoning parser (`--reasoning-parser`, see
`pagedserve/reasoning.py`): whether its thinking is on, whether its prompt already ended the
reasoning, and the split of its outputs into reasoning and content (whole, or streamed). Tool
calls and the content the client sees come from the part after the reasoning."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.reasoning import ReasoningParser, ReasoningStream


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's outputs are split (None where the server has no reasoning parser)."""

    parser: ReasoningParser
    thinking: bool = True
    prompt_ended: bool = False
    include: bool = True  # include_reasoning: false drops the reasoning from the answer

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output's text."""
        return self.parser.split(text, thinking=self.thinking, prompt_ended=self.prompt_ended)

    def stream(self) -> ReasoningStream:
        return self.parser.stream(thinking=self.thinking, prompt_ended=self.prompt_ended)

    def reasoning_tokens(self, output_ids: Sequence[int], reasoning: str | None) -> int:
        return self.parser.reasoning_tokens(output_ids, reasoning is not None)


def plan_reasoning(parser: ReasoningParser | None, template_kwargs: dict[str, Any] | None,
                   prompt_ids: Sequence[int], include: bool = True) -> ReasoningPlan | None:
    if parser is None:
        return None
    return ReasoningPlan(parser, parser.thinking(template_kwargs),
                         parser.is_reasoning_end(prompt_ids), include)
