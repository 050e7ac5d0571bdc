"""LFM2-MoE (`Lfm2MoeForCausalLM`, e.g. LFM2-8B-A1B): LFM2's conv and attention layers
(`models.lfm2`) with a mixture of experts after the first `num_dense_layers` layers.

The router as HF's `Lfm2MoeTopKRouter`: sigmoid scores of the logits; the top `num_experts_per_tok`
chosen by `scores + expert_bias` (`use_expert_bias`; the bias is a buffer, our router's
`e_score_correction_bias`), weighed by the unbiased scores, renormalized with `+ 1e-6` on the sum
(`norm_topk_prob`), times `routed_scaling_factor`. The dense layers' MLP is `intermediate_size`
wide, as written (no LFM2 width adjustment). llama.cpp writes it as architecture "lfm2moe".
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.moe import ExpertPlacement, FusedMoE, MoERouting, expert_param_name
from pagedserve.models.lfm2 import Lfm2ForCausalLM
from pagedserve.models.llama import LlamaMLP

# HF's MoE block names -> ours (after models.lfm2's renames of the dense MLP)
_MOE_RENAMES = ((".feed_forward.expert_bias", ".mlp.gate.e_score_correction_bias"),
                (".feed_forward.", ".mlp."))


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE decoder-only LM on a paged cache (see the module docstring)."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        self.expert_placement = ExpertPlacement(int(config.num_experts), tp,
                                                bool(getattr(config, "enable_expert_parallel", False)))
        super().__init__(config, tp=tp)

    def make_mlp(self, config: Any, layer_index: int, tp: TPContext) -> nn.Module:
        """Layer `layer_index`'s feed-forward block: dense below `num_dense_layers`, else experts
        (sharded along their width, or whole experts per rank with expert parallelism)."""
        if layer_index < config.num_dense_layers:
            return LlamaMLP(config.hidden_size, config.intermediate_size, "silu", tp=tp)
        routing = MoERouting(top_k=int(config.num_experts_per_tok), scoring="sigmoid",
                             renormalize=bool(config.norm_topk_prob), renormalize_eps=1e-6,
                             correction_bias=bool(config.use_expert_bias),
                             routed_scaling_factor=float(config.routed_scaling_factor))
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, int(config.num_experts),
                        routing, act="silu", tp=tp, expert_parallel=self.expert_placement.expert_parallel)

    def _rename(self, name: str) -> str | tuple | None:
        name = super()._rename(name)
        if name is None:
            return None
        for old, new in _MOE_RENAMES:
            name = name.replace(old, new)
        return expert_param_name(name, self.expert_placement)
