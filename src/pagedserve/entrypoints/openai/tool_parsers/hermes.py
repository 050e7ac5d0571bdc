"""``hermes`` (Hermes 2 Pro / 3, Qwen2.5, Qwen3; also vLLM's ``qwen3_json``): each call a JSON
object in ``<tool_call>`` ... ``</tool_call>``; the text before the first one is the content."""

from pagedserve.entrypoints.openai.tool_parsers.base import TaggedJsonToolParser


class HermesToolParser(TaggedJsonToolParser):
    name = "hermes"
    skip_special_tokens = False  # <tool_call> is a special token in some tokenizers
    ARG_KEYS = ("arguments",)
