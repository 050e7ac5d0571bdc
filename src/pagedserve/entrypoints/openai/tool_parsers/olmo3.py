"""``olmo3`` (OLMo 3): pythonic calls one per line, without the list brackets, inside
``<function_calls>`` ... ``</function_calls>``; the text before the block is the content."""

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    content_or_none,
    marker_start,
)
from pagedserve.entrypoints.openai.tool_parsers.pythonic import pythonic_calls


class Olmo3ToolParser(ToolParser):
    name = "olmo3"
    START, END = "<function_calls>", "</function_calls>"

    def parse(self, text, tools=None):
        i = text.find(self.START)
        if i < 0:
            return text, []
        body = text[i + len(self.START):].split(self.END, 1)[0]
        lines = [line.strip() for line in body.splitlines() if line.strip()]
        calls = pythonic_calls("[" + ", ".join(lines) + "]") if lines else None
        return (text, []) if calls is None else (content_or_none(text[:i]), calls)

    def tool_start(self, text):
        return marker_start(text, (self.START,))
