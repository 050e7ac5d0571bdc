"""``granite-20b-fc`` (Granite 20B FunctionCalling): content, then each call as
``<function_call> {"name": ..., "arguments": {...}}``."""

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    call_of,
    content_or_none,
    json_prefix,
    marker_start,
)


class Granite20bFCToolParser(ToolParser):
    name = "granite-20b-fc"
    MARK = "<function_call>"

    def parse(self, text, tools=None):
        if self.MARK not in text:
            return text, []
        content, *segments = text.split(self.MARK)
        calls = []
        for seg in segments:
            value = json_prefix(seg)
            call = call_of(value[0], "arguments") if value else None
            if call is None:
                return text, []
            calls.append(call)
        return content_or_none(content), calls

    def tool_start(self, text):
        return marker_start(text, (self.MARK,))
