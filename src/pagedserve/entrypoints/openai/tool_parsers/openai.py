"""``openai`` (gpt-oss, the harmony format): messages to ``functions.NAME`` are calls, their
body the arguments (JSON, normalized; other text passed on as written); the bodies of ``final``
messages and ``commentary`` preambles are the content; ``analysis`` messages are the reasoning
(``--reasoning-parser openai_gptoss`` returns them; this parser leaves them out). Text before
the first harmony header is content. Reads the whole output or what the reasoning parser left
after the reasoning (see `pagedserve.reasoning.openai_gptoss`)."""

import json

from pagedserve.entrypoints.openai.tool_parsers.base import (
    ToolParser,
    content_or_none,
    loads,
    marker_start,
)
from pagedserve.reasoning.openai_gptoss import HEADER_STARTS, harmony_messages

PREFIX = "functions."


class HarmonyToolParser(ToolParser):
    name = "openai"
    skip_special_tokens = False

    def parse(self, text, tools=None):
        if marker_start(text, HEADER_STARTS) is None or "<|message|>" not in text:
            return text, []
        content, messages = harmony_messages(text)
        calls = []
        for msg in messages:
            to = msg.recipient
            if to is None:
                if msg.channel in ("final", "commentary"):
                    content += msg.body
                continue
            if not to.startswith(PREFIX):
                continue  # a built-in tool (browser, python): not a function call
            # JSON arguments are normalized; anything else is passed on as written (as vLLM)
            value = loads(msg.body)
            args = msg.body if value is None else json.dumps(value, ensure_ascii=False)
            calls.append((to[len(PREFIX):], args))
        return content_or_none(content), calls

    def tool_start(self, text):
        return marker_start(text, HEADER_STARTS)
