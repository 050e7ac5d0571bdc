"""``longcat`` (LongCat-Flash): each call a JSON object in ``<longcat_tool_call>`` ...
``</longcat_tool_call>``; the text before the first one is the content."""

from pagedserve.entrypoints.openai.tool_parsers.base import TaggedJsonToolParser


class LongcatToolParser(TaggedJsonToolParser):
    name = "longcat"
    START, END = "<longcat_tool_call>", "</longcat_tool_call>"
    ARG_KEYS = ("arguments",)
