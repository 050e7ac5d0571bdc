"""``ernie45`` (ERNIE 4.5): each call a JSON object in ``<tool_call>`` ... ``</tool_call>``; the
text before the first one is the content."""

from pagedserve.entrypoints.openai.tool_parsers.base import TaggedJsonToolParser


class Ernie45ToolParser(TaggedJsonToolParser):
    name = "ernie45"
    ARG_KEYS = ("arguments",)
