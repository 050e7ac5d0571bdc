"""``glm45`` / ``glm47`` (GLM-4.5, 4.6, 4.7): ``<think>`` ... ``</think>`` (the newer templates
put ``<think>`` in the prompt); ``enable_thinking: false`` makes the output all content."""

from pagedserve.reasoning.base import ReasoningParser


class Glm45ReasoningParser(ReasoningParser):
    name = "glm45"
    THINKING_SWITCH = True
