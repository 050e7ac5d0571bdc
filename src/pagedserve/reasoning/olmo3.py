"""``olmo3`` (OLMo 3 Think): ``<think>`` ... ``</think>`` written as plain text (several tokens
each, so they need not be single tokens); deepseek_r1's rules otherwise."""

from pagedserve.reasoning.base import ReasoningParser


class Olmo3ReasoningParser(ReasoningParser):
    name = "olmo3"
    SINGLE_TOKENS = False
