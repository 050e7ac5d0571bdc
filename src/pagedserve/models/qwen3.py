"""Qwen3: the Llama decoder with per-head RMSNorm on queries and keys before RoPE.

`head_dim` comes from the config and need not be hidden_size // num_attention_heads.
"""

from __future__ import annotations

from pagedserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 decoder-only LM: Llama + q_norm/k_norm over head_dim (bias per `attention_bias`)."""

    qk_norm = True
