"""``deepseek_v31`` (DeepSeek V3.1): content, then ``<｜tool▁calls▁begin｜>``, each call
``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>``, then
``<｜tool▁calls▁end｜>``."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    arguments_json,
    content_or_none,
    loads,
    marker_start,
)

BEGIN = "<｜tool▁calls▁begin｜>"
_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<args>.*?)"
                   r"(?:<｜tool▁call▁end｜>|<｜tool▁calls▁end｜>|$)", re.DOTALL)


class DeepSeekV31ToolParser(ToolParser):
    name = "deepseek_v31"
    skip_special_tokens = False

    def parse(self, text, tools=None):
        i = text.find(BEGIN)
        if i < 0:
            return text, []
        calls = []
        for m in _CALL.finditer(text, i):
            args = arguments_json(loads(m.group("args")))
            if args is None:
                return text, []
            calls.append((m.group("name").strip(), args))
        return (content_or_none(text[:i]), calls) if calls else (text, [])

    def tool_start(self, text):
        return marker_start(text, (BEGIN,))
