"""``kimi_k2`` (Kimi K2 thinking): ``<think>`` ... ``</think>``, deepseek_r1's rules;
``thinking: false`` makes the output all content."""

from pagedserve.reasoning.base import ReasoningParser


class KimiK2ReasoningParser(ReasoningParser):
    name = "kimi_k2"
    THINKING_SWITCH = True
