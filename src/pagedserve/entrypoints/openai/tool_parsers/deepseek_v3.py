"""``deepseek_v3`` (DeepSeek V3, R1-0528): content, then
``<｜tool▁calls▁begin｜>``, each call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and its
arguments in a fenced JSON block, ``<｜tool▁call▁end｜>``, then ``<｜tool▁calls▁end｜>``."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import SectionToolParser, arguments_json, loads


class DeepSeekV3ToolParser(SectionToolParser):
    name = "deepseek_v3"
    skip_special_tokens = False
    BEGIN = "<｜tool▁calls▁begin｜>"
    CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n"
                      r"(?P<args>.*?)\n```(?:<｜tool▁call▁end｜>|$)", re.DOTALL)

    def call(self, m, tools):
        args = arguments_json(loads(m.group("args")))
        return None if args is None else (m.group("name").strip(), args)
