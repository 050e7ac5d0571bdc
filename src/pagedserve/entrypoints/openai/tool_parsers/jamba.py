"""``jamba`` (AI21 Jamba 1.5+): content, then a JSON list of ``{"name", "arguments"}`` objects in
``<tool_calls>`` ... ``</tool_calls>``."""

from pagedserve.entrypoints.openai.tool_parsers.base import MarkerJsonListToolParser


class JambaToolParser(MarkerJsonListToolParser):
    name = "jamba"
    skip_special_tokens = False
    MARKERS = ("<tool_calls>",)
    CLOSE = "</tool_calls>"
    ARG_KEYS = ("arguments",)
