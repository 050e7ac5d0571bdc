"""``xlam`` (Salesforce xLAM): a JSON list of ``{"name", "arguments"}`` objects, either the whole
output or in a fenced block (```json ... ```), after ``[TOOL_CALLS]``, or in
``<tool_call>`` ... ``</tool_call>``; the text around the block is the content."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    calls_of,
    content_or_none,
    leading_start,
    loads,
    marker_start,
)

_BLOCKS = (re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL),
           re.compile(r"\[TOOL_CALLS\](.*?)(?=\n|$)", re.DOTALL),
           re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL))


class XLamToolParser(ToolParser):
    name = "xlam"

    def parse(self, text, tools=None):
        for pattern in _BLOCKS:
            for m in pattern.finditer(text):
                calls = calls_of(loads(m.group(1).strip()), "arguments", "parameters")
                if calls:
                    content = text[: m.start()] + text[m.end():]
                    return content_or_none(content), calls
        if text.strip().startswith("["):
            calls = calls_of(loads(text.strip()), "arguments", "parameters")
            if calls:
                return None, calls
        return text, []

    def tool_start(self, text):
        found = [i for i in (leading_start(text, ("[",)),
                             marker_start(text, ("```", "[TOOL_CALLS]", "<tool_call>")))
                 if i is not None]
        return min(found) if found else None
