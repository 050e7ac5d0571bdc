"""Reasoning parsers (`--reasoning-parser`, vLLM's names): where a model's thinking ends in its
output. The engine uses `is_reasoning_end` / `ends_reasoning` (token ids) so that structured
outputs apply only after the reasoning; the server uses `split` (text) and `ReasoningStream`
(streamed text) to put the reasoning in the message's `reasoning` field and the rest in
`content`. The rules they share are in `base.py`; each parser is one file here.

With any parser, an output whose prompt already ended the reasoning (the last marker in the
prompt is the END one, as Qwen3's template writes ``<think>\\n\\n</think>`` with thinking off)
is all content, as vLLM's serving layer does (`prompt_is_reasoning_end`).

Adding a parser: a file here with a `ReasoningParser` subclass (its markers and switches), and
its line in `_PARSERS` (name -> module, class). The names are plain data (config.py reads them
without importing the parsers).
"""

from __future__ import annotations

import importlib

from pagedserve.reasoning.base import ReasoningParser, ReasoningStream

# name -> (module in this package, class)
_PARSERS: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("deepseek_r1", "DeepSeekR1ReasoningParser"),
    "deepseek_v3": ("deepseek_v3", "DeepSeekV3ReasoningParser"),
    "ernie45": ("ernie45", "Ernie45ReasoningParser"),
    "glm45": ("glm45", "Glm45ReasoningParser"),
    "glm47": ("glm45", "Glm45ReasoningParser"),
    "granite": ("granite", "GraniteReasoningParser"),
    "hunyuan_a13b": ("hunyuan_a13b", "HunyuanA13BReasoningParser"),
    "kimi_k2": ("kimi_k2", "KimiK2ReasoningParser"),
    "minimax_m2": ("minimax_m2", "MiniMaxM2ReasoningParser"),
    "mistral": ("mistral", "MistralReasoningParser"),
    "olmo3": ("olmo3", "Olmo3ReasoningParser"),
    "openai_gptoss": ("openai_gptoss", "GptOssReasoningParser"),
    "qwen3": ("qwen3", "Qwen3ReasoningParser"),
    "seed_oss": ("seed_oss", "SeedOssReasoningParser"),
    "step3": ("step3", "Step3ReasoningParser"),
}
REASONING_PARSERS = tuple(_PARSERS)


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The class of parser `name` (ValueError naming `reasoning_parser` for an unknown one)."""
    if name not in _PARSERS:
        raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {name!r}")
    module, cls = _PARSERS[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def make_reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    """The parser `name` for `tokenizer`. ValueError for an unknown name, or a tokenizer whose
    vocabulary lacks the parser's tags as single tokens."""
    cls = reasoning_parser_class(name)
    if tokenizer is None:
        raise ValueError(f"reasoning_parser {name!r} needs a tokenizer (the engine runs with "
                         "skip_tokenizer_init)")
    parser = cls.make(tokenizer)
    if parser.name != name:  # an alias (glm47): answer to the name it was asked by
        parser.name = name
    return parser


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "make_reasoning_parser",
           "reasoning_parser_class"]
