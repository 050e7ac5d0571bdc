"""``hunyuan_a13b`` (Hunyuan-A13B): ``<think>\\n`` reasoning ``\\n</think>\\n``, then the answer
in ``<answer>\\n`` ... ``\\n</answer>`` (the wrapper is dropped from the content)."""

from pagedserve.reasoning.base import ReasoningParser


class HunyuanA13BReasoningParser(ReasoningParser):
    name = "hunyuan_a13b"
    START = ("<think>\n",)
    END = ("\n</think>\n",)
    WRAP = ("<answer>\n", "\n</answer>")
    SINGLE_TOKENS = False
