"""``mistral`` (Magistral): ``[THINK]`` ... ``[/THINK]`` (special tokens, kept in the text for
the parser), or ``<think>`` ... ``</think>`` as text for tokenizers before v13. The model chooses
to think: an output that does not open with the tag is all content."""

from pagedserve.reasoning.base import ReasoningParser


class MistralReasoningParser(ReasoningParser):
    name = "mistral"
    START = ("[THINK]", "<think>")
    END = ("[/THINK]", "</think>")
    START_REQUIRED = True
    SINGLE_TOKENS = False
    skip_special_tokens = False
