"""``minimax_m2`` (MiniMax-M2): content, then

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="KEY">VALUE</parameter>
    </invoke>
    </minimax:tool_call>

(several invokes per block); values typed by the function's parameters schema."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    content_or_none,
    marker_start,
    typed_arguments,
)

START = "<minimax:tool_call>"
_INVOKE = re.compile(r"<invoke\s+name\s*=\s*[\"']?([^\"'>]+)[\"']?\s*>(.*?)(?:</invoke>|$)",
                     re.DOTALL)
_PARAMETER = re.compile(r"<parameter\s+name\s*=\s*[\"']?([^\"'>]+)[\"']?\s*>(.*?)"
                        r"(?:</parameter>|$)", re.DOTALL)


class MinimaxM2ToolParser(ToolParser):
    name = "minimax_m2"

    def parse(self, text, tools=None):
        i = text.find(START)
        if i < 0:
            return text, []
        calls = []
        for m in _INVOKE.finditer(text, i):
            name = m.group(1).strip()
            params = {p.group(1).strip(): p.group(2) for p in _PARAMETER.finditer(m.group(2))}
            calls.append((name, typed_arguments(tools, name, params)))
        return (content_or_none(text[:i]), calls) if calls else (text, [])

    def tool_start(self, text):
        return marker_start(text, (START,))
