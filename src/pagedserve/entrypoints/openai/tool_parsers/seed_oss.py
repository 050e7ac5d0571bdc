"""``seed_oss`` (ByteDance Seed-OSS): qwen3_coder's ``<function=...>`` / ``<parameter=...>``
calls inside ``<seed:tool_call>`` ... ``</seed:tool_call>``."""

from pagedserve.entrypoints.openai.tool_parsers.base import marker_start
from pagedserve.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser


class SeedOssToolParser(Qwen3CoderToolParser):
    name = "seed_oss"
    START, END = "<seed:tool_call>", "</seed:tool_call>"

    def parse(self, text, tools=None):
        if self.START not in text:
            return text, []
        i = text.index(self.START)
        content, calls = super().parse(text[i:], tools)
        return (text, []) if not calls else (text[:i] if text[:i].strip() else None, calls)

    def tool_start(self, text):
        return marker_start(text, (self.START,))
