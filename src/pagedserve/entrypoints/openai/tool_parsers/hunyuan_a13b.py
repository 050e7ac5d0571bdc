"""``hunyuan_a13b`` (Hunyuan-A13B): content, then a JSON list of ``{"name", "arguments"}``
objects in ``<tool_calls>`` ... ``</tool_calls>``."""

from pagedserve.entrypoints.openai.tool_parsers.base import MarkerJsonListToolParser


class HunyuanA13BToolParser(MarkerJsonListToolParser):
    name = "hunyuan_a13b"
    MARKERS = ("<tool_calls>",)
    CLOSE = "</tool_calls>"
    ARG_KEYS = ("arguments",)
