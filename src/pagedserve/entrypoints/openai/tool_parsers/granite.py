"""``granite`` (Granite 3.0 / 3.1): content, then ``<|tool_call|>`` (3.0, a special token) or
``<tool_call>`` (3.1) and a JSON list of ``{"name", "arguments"}`` objects."""

from pagedserve.entrypoints.openai.tool_parsers.base import MarkerJsonListToolParser


class GraniteToolParser(MarkerJsonListToolParser):
    name = "granite"
    skip_special_tokens = False
    MARKERS = ("<|tool_call|>", "<tool_call>")
    ARG_KEYS = ("arguments",)
