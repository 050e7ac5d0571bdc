"""``granite`` (Granite 3.2+ with ``thinking: true``): "Here is my thought process:" (or
"Here's ...") opens the reasoning and "Here is my response:" (or "Here's ...") the content; an
output that does not open with the first is all content. (vLLM also reads the first phrase
further into the text, and returns a finished output without the second as all content, which
its own stream does not; here an output cut short while thinking is reasoning, as in the other
parsers, so the stream and the whole answer agree.)"""

from pagedserve.reasoning.base import ReasoningParser


class GraniteReasoningParser(ReasoningParser):
    name = "granite"
    START = ("Here is my thought process:", "Here's my thought process:")
    END = ("Here is my response:", "Here's my response:")
    START_REQUIRED = True
    SINGLE_TOKENS = False
