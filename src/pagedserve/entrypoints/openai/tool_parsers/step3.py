"""``step3`` (StepFun Step-3): content, then

    <｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="NAME">
    <steptml:parameter name="KEY">VALUE</steptml:parameter></steptml:invoke><｜tool_call_end｜>
    <｜tool_calls_end｜>

values typed by the function's parameters schema."""

import re

from pagedserve.entrypoints.openai.tool_parsers.base import SectionToolParser, typed_arguments

_INVOKE = re.compile(r'<steptml:invoke name="([^"]+)">(.*?)(?:</steptml:invoke>|$)', re.DOTALL)
_PARAMETER = re.compile(r'<steptml:parameter name="([^"]+)">(.*?)(?:</steptml:parameter>|$)',
                        re.DOTALL)


class Step3ToolParser(SectionToolParser):
    name = "step3"
    skip_special_tokens = False
    BEGIN = "<｜tool_calls_begin｜>"
    CALL = re.compile(r"<｜tool_call_begin｜>(.*?)(?:<｜tool_call_end｜>|<｜tool_calls_end｜>|$)",
                      re.DOTALL)

    def call(self, m, tools):
        kind, sep, invoke = m.group(1).partition("<｜tool_sep｜>")
        inv = _INVOKE.search(invoke) if sep else None
        if inv is None or kind.strip() != "function":
            return None
        name = inv.group(1).strip()
        params = {p.group(1): p.group(2) for p in _PARAMETER.finditer(inv.group(2))}
        return name, typed_arguments(tools, name, params)
