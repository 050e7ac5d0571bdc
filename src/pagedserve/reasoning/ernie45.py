"""``ernie45`` (ERNIE-4.5 thinking): deepseek_r1's split; the content after ``</think>`` may be
wrapped in ``<response>`` ... ``</response>``, which is dropped from it."""

from pagedserve.reasoning.base import ReasoningParser


class Ernie45ReasoningParser(ReasoningParser):
    name = "ernie45"
    WRAP = ("<response>", "</response>")
