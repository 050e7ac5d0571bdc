"""``step3`` (StepFun Step-3): the text before ``</think>`` is the reasoning (the template opens
the thinking in the prompt; the model never writes ``<think>``); no ``</think>``: all
reasoning."""

from pagedserve.reasoning.base import ReasoningParser


class Step3ReasoningParser(ReasoningParser):
    name = "step3"
    START = ()
