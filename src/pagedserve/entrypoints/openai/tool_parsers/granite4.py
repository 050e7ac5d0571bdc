"""``granite4`` (Granite 4): each call a JSON object in ``<tool_call>`` ... ``</tool_call>``; the
text outside the calls (before, between and after them) is the content."""

from pagedserve.entrypoints.openai.tool_parsers.base import TaggedJsonToolParser


class Granite4ToolParser(TaggedJsonToolParser):
    name = "granite4"
    skip_special_tokens = False
    ARG_KEYS = ("arguments",)
    KEEP_BETWEEN = True
