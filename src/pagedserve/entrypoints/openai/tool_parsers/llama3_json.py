"""``llama3_json`` / ``llama4_json``: the whole output is ``{"name": ..., "parameters": {...}}``
(optionally after ``<|python_tag|>``), several separated by ``;``."""

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    call_of,
    json_prefix,
    leading_start,
)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text, tools=None):
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        while body:
            value = json_prefix(body)
            call = call_of(value[0], "parameters", "arguments") if value else None
            if call is None:
                return text, []
            calls.append(call)
            body = body[value[1]:].lstrip()
            if body.startswith(";"):
                body = body[1:].lstrip()
            elif body:
                return text, []
        return None, calls

    def tool_start(self, text):
        return leading_start(text, ("{", self.TAG))
