"""dots.llm1 (`Dots1ForCausalLM`, rednote-hilab): Qwen3's attention with DeepSeek-V3's mixture of
experts.

As in HF 5.x (`Dots1Model` over Qwen3's attention and DeepSeek-V3's layers):
- attention: per-head q / k RMSNorm before RoPE (always), q / k / v and o biases with
  `attention_bias`, whole-head RoPE, sliding windows on the `layer_types` "sliding_attention"
  layers (HF's default: from `max_window_layers` on, when `sliding_window` is set);
- feed-forward: GLM-4.5's (`models.glm4_moe`): dense gated MLPs in the first
  `first_k_dense_replace` layers, then DeepSeek-V3's routing (sigmoid scores chosen with the
  correction bias, grouped top-k, `norm_topk_prob`, `routed_scaling_factor`) beside the shared
  experts.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from pagedserve.distributed.tp import TPContext
from pagedserve.layers.norms import RMSNorm
from pagedserve.models.glm4_moe import Glm4MoeForCausalLM
from pagedserve.models.llama import LlamaAttention, head_dim_of, layer_sliding_windows


class Dots1ForCausalLM(Glm4MoeForCausalLM):
    """dots.llm1 decoder-only LM on a paged KV cache (see the module docstring)."""

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return layer_sliding_windows(config)

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module]:
        head_dim, eps = head_dim_of(config), config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        windows = self.sliding_windows(config)
        return lambda i: LlamaAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            scale=head_dim**-0.5, sliding_window=windows[i], qkv_bias=bias, o_bias=bias,
            qk_norm=lambda d: RMSNorm(d, eps), tp=tp)
