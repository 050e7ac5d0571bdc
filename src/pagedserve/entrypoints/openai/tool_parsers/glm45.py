"""``glm45`` / ``glm47`` (GLM-4.5, 4.6, 4.7): content, then each call as

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

(GLM-4.7 writes no newline after the name); values typed by the function's parameters schema."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import SectionToolParser, typed_arguments

_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.DOTALL)


class Glm45ToolParser(SectionToolParser):
    name = "glm45"
    skip_special_tokens = False
    BEGIN = "<tool_call>"
    CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def call(self, m, tools):
        body = m.group(1)
        name = body.split("<arg_key>", 1)[0].strip()
        if not name or any(c in name for c in "<>{}\n"):
            return None
        params = {a.group(1).strip(): a.group(2) for a in _ARG.finditer(body)}
        return name, typed_arguments(tools, name, params)
