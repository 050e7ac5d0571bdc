"""``phi4_mini_json`` (Phi-4-mini): ``functools[...]``, a JSON list of ``{"name", "arguments"}``
(or ``"parameters"``) objects after the word ``functools``."""

from pagedserve.entrypoints.openai.tool_parsers.base import MarkerJsonListToolParser


class Phi4MiniJsonToolParser(MarkerJsonListToolParser):
    name = "phi4_mini_json"
    MARKERS = ("functools[",)

    def split(self, text):
        where = super().split(text)
        return None if where is None else (where[0], where[1] - 1)  # the list starts at "["
