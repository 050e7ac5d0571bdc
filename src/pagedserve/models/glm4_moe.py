"""GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`): Llama-style attention with DeepSeek-V3's mixture of
experts.

As in HF 5.x:
- attention: q / k / v with biases (`attention_bias`; o_proj has none), optional per-head q / k
  RMSNorm (`use_qk_norm`), RoPE over the first `partial_rotary_factor` of each head in the
  rotate-half layout (not GLM-4's interleaved pairs);
- feed-forward: a dense gated MLP in the first `first_k_dense_replace` layers, then a
  `FusedMoE` routed as DeepSeek-V3's (sigmoid scores, the selection-only
  `e_score_correction_bias`, grouped top-k by the sum of each group's best two, renormalized,
  `routed_scaling_factor`; the router in float32) beside `n_shared_experts` shared ones as one
  plain MLP (checkpoint name `shared_experts`, ours `shared_expert`);
- checkpoints of GLM-4.5 carry `num_nextn_predict_layers` multi-token-prediction layers after the
  last decoder layer (`model.layers.<num_hidden_layers + i>`); HF's model does not run them and
  neither do we: they are skipped at load.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from torch import nn

from pagedserve.distributed.tp import TPContext
from pagedserve.layers.norms import RMSNorm
from pagedserve.models.deepseek_v2 import deepseek_moe
from pagedserve.models.llama import LlamaAttention, LlamaMLP, head_dim_of
from pagedserve.models.mixtral import MoECausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeForCausalLM(MoECausalLM):
    """GLM-4.5 MoE decoder-only LM on a paged KV cache (see the module docstring)."""

    @staticmethod
    def num_experts(config: Any) -> int:
        return int(config.n_routed_experts)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [None] * config.num_hidden_layers

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module]:
        head_dim = head_dim_of(config)
        eps = config.rms_norm_eps
        qk_norm = (lambda d: RMSNorm(d, eps)) if getattr(config, "use_qk_norm", False) else None
        return lambda i: LlamaAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            scale=head_dim**-0.5, sliding_window=None,
            qkv_bias=bool(getattr(config, "attention_bias", False)), o_bias=False, qk_norm=qk_norm, tp=tp)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        if layer < int(getattr(config, "first_k_dense_replace", 0) or 0):
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        return deepseek_moe(config, v3=True, tp=tp, expert_parallel=self.expert_placement.expert_parallel)

    def _rename(self, name: str) -> str | tuple | None:
        m = _LAYER.match(name)
        if m is not None and int(m[1]) >= self.config.num_hidden_layers:
            return None  # a multi-token-prediction layer (see the module docstring)
        return super()._rename(name.replace(".mlp.shared_experts.", ".mlp.shared_expert."))
