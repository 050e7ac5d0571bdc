"""``mistral``: content, then ``[TOOL_CALLS]`` and either a JSON list of
``{"name", "arguments"}`` objects (tokenizers before v11) or, from v11 on, one call per marker as
``name[ARGS]{...}`` (or ``name{...}``): ``[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}``."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    arguments_json,
    calls_of,
    content_or_none,
    json_prefix,
    marker_start,
)

_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?")


class MistralToolParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False  # [TOOL_CALLS] and [ARGS] are special tokens
    MARK = "[TOOL_CALLS]"

    def parse(self, text, tools=None):
        if self.MARK not in text:
            return text, []
        content, *segments = text.split(self.MARK)
        calls = []
        for seg in segments:
            if seg.lstrip().startswith(("[", "{")):  # pre-v11: a JSON list (or one object)
                value = json_prefix(seg)
                found = calls_of(value[0], "arguments") if value else None
                if found is None:
                    return text, []
                calls += found
                continue
            m = _NAME.match(seg)
            value = json_prefix(seg[m.end():]) if m else None
            args = arguments_json(value[0]) if value and isinstance(value[0], dict) else None
            if args is None:
                return text, []
            calls.append((m.group(1), args))
        return content_or_none(content), calls

    def tool_start(self, text):
        return marker_start(text, (self.MARK,))
