"""``minimax_m2`` (MiniMax-M2): content, then

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="KEY">VALUE</parameter>
    </invoke>
    </minimax:tool_call>

(several invokes per block); values typed by the function's parameters schema."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import SectionToolParser, typed_arguments

_PARAMETER = re.compile(r"<parameter\s+name\s*=\s*[\"']?([^\"'>]+)[\"']?\s*>(.*?)"
                        r"(?:</parameter>|$)", re.DOTALL)


class MinimaxM2ToolParser(SectionToolParser):
    name = "minimax_m2"
    BEGIN = "<minimax:tool_call>"
    CALL = re.compile(r"<invoke\s+name\s*=\s*[\"']?([^\"'>]+)[\"']?\s*>(.*?)(?:</invoke>|$)",
                      re.DOTALL)

    def call(self, m, tools):
        name = m.group(1).strip()
        params = {p.group(1).strip(): p.group(2) for p in _PARAMETER.finditer(m.group(2))}
        return name, typed_arguments(tools, name, params)
