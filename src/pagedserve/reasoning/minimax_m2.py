"""``minimax_m2`` (MiniMax-M2): the template opens ``<think>`` in the prompt; the text before
``</think>`` is the reasoning (deepseek_r1's rules)."""

from pagedserve.reasoning.base import ReasoningParser


class MiniMaxM2ReasoningParser(ReasoningParser):
    name = "minimax_m2"
