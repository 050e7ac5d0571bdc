"""``internlm`` (InternLM 2 / 2.5): content, then one call
``<|action_start|><|plugin|>{"name": ..., "parameters": {...}}<|action_end|>``."""

from pagedserve.entrypoints.openai.tool_parsers.base import MarkerJsonListToolParser


class Internlm2ToolParser(MarkerJsonListToolParser):
    name = "internlm"
    skip_special_tokens = False
    MARKERS = ("<|action_start|><|plugin|>",)
    CLOSE = "<|action_end|>"
    ARG_KEYS = ("parameters", "arguments")
