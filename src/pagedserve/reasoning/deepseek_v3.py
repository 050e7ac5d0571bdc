"""``deepseek_v3`` (DeepSeek V3.1 / V3.2, hybrid thinking): thinks only when the request asks
(`chat_template_kwargs` ``thinking: true`` or ``enable_thinking: true``), then as deepseek_r1;
otherwise the output is all content (vLLM's identity parser). A prompt with no think tag has not
opened a reasoning (the engine applies structured outputs from the first token)."""

from pagedserve.reasoning.base import ReasoningParser


class DeepSeekV3ReasoningParser(ReasoningParser):
    name = "deepseek_v3"
    THINKING_SWITCH = True
    THINKING_DEFAULT = False
