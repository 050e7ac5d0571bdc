"""``deepseek_r1`` (DeepSeek-R1 and its distills): the text before ``</think>`` is the
reasoning, with or without a ``<think>`` (R1's template puts it in the prompt); an output
without ``</think>`` is all reasoning (cut short while thinking)."""

from pagedserve.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
