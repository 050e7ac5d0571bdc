"""Structured outputs (JSON schema, regex, choice, grammar) with xgrammar: request parameters
(`params`), the engine's matchers and per-step bitmask (`manager`), and the bitmask's application
in the sampler (`bitmask.apply_bitmask`, `kernels.cpu_grammar`)."""

from pagedserve.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
