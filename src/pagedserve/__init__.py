"""pagedserve: LLM inference and serving with PagedAttention.

The public API is vLLM's: `LLM`, `SamplingParams`, `RequestOutput`, `CompletionOutput`.
Imports are lazy so that `import pagedserve` stays light (no model, server or GGUF code).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pagedserve.engine.llm",
    "LLMEngine": "pagedserve.engine.llm_engine",
    "EngineArgs": "pagedserve.config",
    "AsyncEngineArgs": "pagedserve.config",
    "AsyncLLMEngine": "pagedserve.engine.async_engine",
    "TokensPrompt": "pagedserve.inputs",
    "TextPrompt": "pagedserve.inputs",
    "SamplingParams": "pagedserve.sampling_params",
    "StructuredOutputsParams": "pagedserve.structured_output.params",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "Logprob": "pagedserve.outputs",
    "BeamSearchParams": "pagedserve.core.beam_search",
    "PoolingParams": "pagedserve.pooling_params",
    "PoolingRequestOutput": "pagedserve.outputs",
    "EmbeddingRequestOutput": "pagedserve.outputs",
    "ScoringRequestOutput": "pagedserve.outputs",
    "ClassificationRequestOutput": "pagedserve.outputs",
    "BeamSearchOutput": "pagedserve.core.beam_search",
    "LoRARequest": "pagedserve.lora.request",
}

__all__ = list(_LAZY)

if TYPE_CHECKING:  # pragma: no cover
    from pagedserve.config import AsyncEngineArgs, EngineArgs
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.inputs import TextPrompt, TokensPrompt
    from pagedserve.core.beam_search import BeamSearchOutput, BeamSearchParams
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.lora.request import LoRARequest
    from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.structured_output.params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
