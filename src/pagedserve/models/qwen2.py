"""Qwen2 / Qwen2.5: the Llama decoder with biased q/k/v projections.

Sliding windows follow HF: the config keeps `sliding_window` but nulls it unless
`use_sliding_window` is true, and then only `layer_types[i] == "sliding_attention"` layers (by
default those with index >= `max_window_layers`) use it (see `llama.layer_sliding_windows`).
"""

from __future__ import annotations

from pagedserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 decoder-only LM: Llama + q/k/v bias (o_proj has none)."""

    qkv_bias = True
