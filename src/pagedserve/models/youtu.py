"""Youtu (`YoutuForCausalLM`: Tencent's Youtu-LLM).

DeepSeek V3's decoder without experts, as in HF 5.x: multi-head latent attention
(`layers.mla.MLAttention`: the paged cache holds one latent row per token; RoPE on
`qk_rope_head_dim`, interleaved by default, `rope_interleave`) and a dense gated MLP in every
layer; the LM head tied by default. `models.deepseek_v2` serves it: `YoutuConfig` names no
routed experts, so every layer is dense (`is_moe_layer`).
From GGUF: llama.cpp's converter writes it as "deepseek2" (conversion/deepseek.py), every layer a
leading dense block (`models.gguf_families`).
"""

from __future__ import annotations

from typing import Any

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.models.deepseek_v2 import DeepseekV3ForCausalLM


class YoutuForCausalLM(DeepseekV3ForCausalLM):
    """Youtu decoder-only LM on a paged latent cache (see the module docstring)."""

    tied_by_default = True

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        if getattr(config, "n_routed_experts", None):
            raise ValueError("Youtu with routed experts (n_routed_experts) is not supported: it is a dense model")
        super().__init__(config, tp=tp)
