"""``kimi_k2`` (Kimi K2): content, then ``<|tool_calls_section_begin|>``, each call
``<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{arguments}<|tool_call_end|>``,
then ``<|tool_calls_section_end|>``."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    arguments_json,
    content_or_none,
    loads,
    marker_start,
)

BEGIN = "<|tool_calls_section_begin|>"
_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^<]+?)\s*<\|tool_call_argument_begin\|>"
                   r"(?P<args>.*?)(?:<\|tool_call_end\|>|<\|tool_calls_section_end\|>|$)",
                   re.DOTALL)


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
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
            # the id is "functions.NAME:INDEX"
            name = m.group("id").rsplit(":", 1)[0].strip().removeprefix("functions.")
            calls.append((name, args))
        return (content_or_none(text[:i]), calls) if calls else (text, [])

    def tool_start(self, text):
        return marker_start(text, (BEGIN,))
