"""``deepseek_v3`` (DeepSeek V3, R1-0528): content, then
``<｜tool▁calls▁begin｜>``, each call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and its
arguments in a fenced JSON block, ``<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    arguments_json,
    content_or_none,
    loads,
    marker_start,
)

BEGIN = "<｜tool▁calls▁begin｜>"
_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n"
                   r"(?P<args>.*?)\n```(?:<｜tool▁call▁end｜>|$)", re.DOTALL)


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
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
