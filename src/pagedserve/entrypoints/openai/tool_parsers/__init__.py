"""Tool-call parsers (`--tool-call-parser`, vLLM's names): how `tool_choice: "auto"` calls are
read from a model's text. Each parser is one file here (a `base.ToolParser` subclass; the
families share the bases in `base.py`); a request's plan uses it through `tool_calls.py`.

Adding a parser: a file here with its class, and its line in `_PARSERS` (name -> module,
class). Several names may share a class (vLLM's aliases: llama4_json, qwen3_xml, glm47, ...).
"""

from __future__ import annotations

import importlib

from pagedserve.entrypoints.openai.tool_parsers.base import ParsedCall, ToolParser

# name -> (module in this package, class)
_PARSERS: dict[str, tuple[str, str]] = {
    "deepseek_v3": ("deepseek_v3", "DeepSeekV3ToolParser"),
    "deepseek_v31": ("deepseek_v31", "DeepSeekV31ToolParser"),
    "ernie45": ("ernie45", "Ernie45ToolParser"),
    "glm45": ("glm45", "Glm45ToolParser"),
    "glm47": ("glm45", "Glm45ToolParser"),
    "granite": ("granite", "GraniteToolParser"),
    "granite-20b-fc": ("granite_20b_fc", "Granite20bFCToolParser"),
    "granite4": ("granite4", "Granite4ToolParser"),
    "hermes": ("hermes", "HermesToolParser"),
    "hunyuan_a13b": ("hunyuan_a13b", "HunyuanA13BToolParser"),
    "internlm": ("internlm", "Internlm2ToolParser"),
    "jamba": ("jamba", "JambaToolParser"),
    "kimi_k2": ("kimi_k2", "KimiK2ToolParser"),
    "lfm2": ("lfm2", "Lfm2ToolParser"),
    "llama3_json": ("llama3_json", "Llama3JsonToolParser"),
    "llama4_json": ("llama3_json", "Llama3JsonToolParser"),
    "llama4_pythonic": ("llama4_pythonic", "Llama4PythonicToolParser"),
    "longcat": ("longcat", "LongcatToolParser"),
    "minimax_m2": ("minimax_m2", "MinimaxM2ToolParser"),
    "mistral": ("mistral", "MistralToolParser"),
    "olmo3": ("olmo3", "Olmo3ToolParser"),
    "openai": ("openai", "HarmonyToolParser"),
    "phi4_mini_json": ("phi4_mini_json", "Phi4MiniJsonToolParser"),
    "pythonic": ("pythonic", "PythonicToolParser"),
    "qwen3_coder": ("qwen3_coder", "Qwen3CoderToolParser"),
    "qwen3_json": ("hermes", "HermesToolParser"),
    "qwen3_xml": ("qwen3_coder", "Qwen3CoderToolParser"),
    "seed_oss": ("seed_oss", "SeedOssToolParser"),
    "step3": ("step3", "Step3ToolParser"),
    "xlam": ("xlam", "XLamToolParser"),
}
TOOL_PARSERS = tuple(_PARSERS)


def make_tool_parser(name: str) -> ToolParser:
    """The parser named `name` (ValueError listing the known ones)."""
    if name not in _PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, "
                         f"got {name!r}")
    module, cls = _PARSERS[name]
    parser = getattr(importlib.import_module(f"{__name__}.{module}"), cls)()
    parser.name = name
    return parser


__all__ = ["TOOL_PARSERS", "ParsedCall", "ToolParser", "make_tool_parser"]
