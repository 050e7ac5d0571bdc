"""``lfm2`` (Liquid LFM2): a pythonic list between ``<|tool_call_start|>`` and
``<|tool_call_end|>``; the text outside the calls is the content."""

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    content_or_none,
    marker_start,
)
from pagedserve.entrypoints.openai.tool_parsers.pythonic import pythonic_calls


class Lfm2ToolParser(ToolParser):
    name = "lfm2"
    skip_special_tokens = False
    START, END = "<|tool_call_start|>", "<|tool_call_end|>"

    def parse(self, text, tools=None):
        if self.START not in text:
            return text, []
        content, calls, rest = "", [], text
        while self.START in rest:
            before, _, after = rest.partition(self.START)
            content += before
            body, _, rest = after.partition(self.END)
            found = pythonic_calls(body)
            if found is None:
                return text, []
            calls += found
        return content_or_none(content + rest), calls

    def tool_start(self, text):
        return marker_start(text, (self.START,))
