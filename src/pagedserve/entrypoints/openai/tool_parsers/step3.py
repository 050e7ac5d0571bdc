"""``step3`` (StepFun Step-3): content, then

    <｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="NAME">
    <steptml:parameter name="KEY">VALUE</steptml:parameter></steptml:invoke><｜tool_call_end｜>
    <｜tool_calls_end｜>

values typed by the function's parameters schema."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    content_or_none,
    marker_start,
    typed_arguments,
)

BEGIN = "<｜tool_calls_begin｜>"
_CALL = re.compile(r"<｜tool_call_begin｜>(.*?)(?:<｜tool_call_end｜>|<｜tool_calls_end｜>|$)",
                   re.DOTALL)
_INVOKE = re.compile(r'<steptml:invoke name="([^"]+)">(.*?)(?:</steptml:invoke>|$)', re.DOTALL)
_PARAMETER = re.compile(r'<steptml:parameter name="([^"]+)">(.*?)(?:</steptml:parameter>|$)',
                        re.DOTALL)


class Step3ToolParser(ToolParser):
    name = "step3"
    skip_special_tokens = False

    def parse(self, text, tools=None):
        i = text.find(BEGIN)
        if i < 0:
            return text, []
        calls = []
        for m in _CALL.finditer(text, i):
            kind, sep, invoke = m.group(1).partition("<｜tool_sep｜>")
            inv = _INVOKE.search(invoke) if sep else None
            if inv is None or kind.strip() != "function":
                return text, []
            name = inv.group(1).strip()
            params = {p.group(1): p.group(2) for p in _PARAMETER.finditer(inv.group(2))}
            calls.append((name, typed_arguments(tools, name, params)))
        return (content_or_none(text[:i]), calls) if calls else (text, [])

    def tool_start(self, text):
        return marker_start(text, (BEGIN,))
