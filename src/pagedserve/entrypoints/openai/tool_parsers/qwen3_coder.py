"""``qwen3_coder`` / ``qwen3_xml`` (Qwen3-Coder, Qwen3.5, Qwen3-Next): content, then calls as

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Each value is text (one newline each side is the template's layout), typed by the function's
parameters schema (integer, number, boolean, object, array, null; else kept as text)."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    content_or_none,
    marker_start,
    strip_one_newline,
    typed_arguments,
)

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                        re.DOTALL)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    START, END = "<tool_call>", "</tool_call>"
    FUNCTION = "<function="

    def parse(self, text, tools=None):
        starts = [i for i in (text.find(self.START), text.find(self.FUNCTION)) if i >= 0]
        if not starts:
            return text, []
        first = min(starts)
        calls = []
        for m in _FUNCTION.finditer(text, first):
            name = m.group(1).strip()
            params = {p.group(1).strip(): strip_one_newline(p.group(2))
                      for p in _PARAMETER.finditer(m.group(2))}
            calls.append((name, typed_arguments(tools, name, params)))
        return (content_or_none(text[:first]), calls) if calls else (text, [])

    def tool_start(self, text):
        return marker_start(text, (self.START, self.FUNCTION))
