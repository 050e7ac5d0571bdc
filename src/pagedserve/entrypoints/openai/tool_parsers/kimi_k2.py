"""``kimi_k2`` (Kimi K2): content, then ``<|tool_calls_section_begin|>``, each call
``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{arguments}<|tool_call_end|>``,
then ``<|tool_calls_section_end|>``."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import SectionToolParser, arguments_json, loads


class KimiK2ToolParser(SectionToolParser):
    name = "kimi_k2"
    skip_special_tokens = False
    BEGIN = "<|tool_calls_section_begin|>"
    CALL = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>"
                      r"(?P<args>.*?)(?:<\|tool_call_end\|>|<\|tool_calls_section_end\|>|$)",
                      re.DOTALL)

    def call(self, m, tools):
        args = arguments_json(loads(m.group("args")))
        if args is None:
            return None
        # the id is "functions.NAME:INDEX"
        return m.group("id").rsplit(":", 1)[0].strip().removeprefix("functions."), args
