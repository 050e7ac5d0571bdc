"""``qwen3`` (Qwen3, Qwen3.5; vLLM's current rules): deepseek_r1's split (``<think>`` in the
prompt or in the output), except that with thinking switched off (`chat_template_kwargs`
``enable_thinking: false``, or ``thinking: false``) the output is all content. (vLLM's parser
before Qwen3.5 required both tags in the output; the current one does not.)"""

from pagedserve.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    THINKING_SWITCH = True
