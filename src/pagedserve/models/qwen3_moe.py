"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, explicit head_dim) and a mixture of
experts without a shared expert (`layers.moe.FusedMoE`); layers listed in `mlp_only_layers`, or
off the `decoder_sparse_step` pattern, keep a dense MLP (as HF's)."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.distributed.tp import TPContext
from pagedserve.layers.moe import FusedMoE, MoERouting
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.mixtral import MoECausalLM


def is_sparse_layer(config: Any, layer: int) -> bool:
    """Whether HF's Qwen2/3-MoE put experts in `layer`: not in `mlp_only_layers`, experts at all,
    and `(layer + 1) % decoder_sparse_step == 0`."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (layer not in (getattr(config, "mlp_only_layers", None) or [])
            and int(config.num_experts) > 0 and (layer + 1) % step == 0)


class Qwen3MoeForCausalLM(MoECausalLM):
    """Qwen3-MoE decoder-only LM (softmax router, `norm_topk_prob`, `moe_intermediate_size`)."""

    qk_norm = True

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        """`sliding_window` on every layer when `use_sliding_window`, else none (as HF's)."""
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
        return [window] * config.num_hidden_layers

    def routing(self, config: Any) -> MoERouting:
        """The router's rules: softmax top-k, renormalized by `norm_topk_prob`."""
        return MoERouting.from_config(config)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        if not is_sparse_layer(config, layer):
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, int(config.num_experts),
                        self.routing(config), act=config.hidden_act, tp=tp,
                        expert_parallel=self.expert_placement.expert_parallel)
