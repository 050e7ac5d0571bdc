"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias per `qkv_bias`) and a
mixture of experts with a shared expert scaled by a sigmoid gate (`layers.moe.FusedMoE` with
`shared_intermediate_size` and `shared_gate`); `mlp_only_layers` / `decoder_sparse_step` keep
some layers dense, as HF's."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.distributed.tp import TPContext
from pagedserve.layers.moe import FusedMoE, MoERouting
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.mixtral import MoECausalLM
from pagedserve.models.qwen3_moe import is_sparse_layer


class Qwen2MoeForCausalLM(MoECausalLM):
    """Qwen2-MoE decoder-only LM: softmax router (`norm_topk_prob`), `moe_intermediate_size`
    experts, a `shared_expert_intermediate_size` shared expert with `shared_expert_gate`."""

    def uses_qkv_bias(self, config: Any) -> bool:
        return bool(getattr(config, "qkv_bias", True))

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        if not is_sparse_layer(config, layer):
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, int(config.num_experts),
                        MoERouting.from_config(config), act=config.hidden_act,
                        shared_intermediate_size=int(config.shared_expert_intermediate_size or 0),
                        shared_act=config.hidden_act, shared_gate=True, tp=tp,
                        expert_parallel=self.expert_placement.expert_parallel)
