"""``llama4_pythonic`` (Llama 4): pythonic calls, optionally wrapped in ``<|python_start|>`` ...
``<|python_end|>``."""

from pagedserve.entrypoints.openai.tool_parsers.base import ToolParser, leading_start
from pagedserve.entrypoints.openai.tool_parsers.pythonic import pythonic_calls


class Llama4PythonicToolParser(ToolParser):
    name = "llama4_pythonic"
    skip_special_tokens = False
    START, END = "<|python_start|>", "<|python_end|>"

    def parse(self, text, tools=None):
        body = text.strip()
        if body.startswith(self.START):
            body = body[len(self.START):].replace(self.END, "")
        calls = pythonic_calls(body)
        return (text, []) if calls is None else (None, calls)

    def tool_start(self, text):
        return leading_start(text, ("[", self.START))
