"""HunYuan V3 (`HYV3ForCausalLM`, Tencent Hy3): Qwen3-MoE's attention (per-head q / k RMSNorms
before RoPE, GQA) with sigmoid-routed experts and a shared MLP.

As in HF 5.x (`modeling_hy_v3.py`):
- a gated MLP on the "dense" layers of `mlp_layer_types` (HF's default: the first), experts on
  the "sparse" ones;
- the router (`mlp.router.gate`, float32): sigmoid of the logits, the top `num_experts_per_tok`
  chosen by `scores + e_score_correction_bias` (the checkpoint's `mlp.expert_bias`), weighed by
  the unbiased scores over their sum (+ 1e-20), times `router_scaling_factor`;
- a shared MLP of `moe_intermediate_size * num_shared_experts` (`mlp.shared_mlp`) added to the
  experts' sum (HF adds them in float32 under `enable_moe_fp32_combine`: the same in float32);
- one RoPE (`rope_parameters`), no sliding window; layers past `num_hidden_layers` in a
  checkpoint (its multi-token-prediction block) are skipped.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.distributed.tp import TPContext
from pagedserve.layers.moe import FusedMoE, MoERouting
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.mixtral import MoECausalLM


def hy_v3_mlp_types(config: Any) -> list[str]:
    """Each layer's feed-forward ("dense" / "sparse"), as HF's config derives it."""
    n = config.num_hidden_layers
    types = getattr(config, "mlp_layer_types", None) or (["dense"] + ["sparse"] * (n - 1))[:n]
    if len(types) != n:
        raise ValueError(f"config.mlp_layer_types has {len(types)} entries for {n} layers")
    return list(types)


class HYV3ForCausalLM(MoECausalLM):
    """HunYuan V3 decoder-only LM on a paged KV cache (see the module docstring)."""

    qk_norm = True
    moe_aliases = {".mlp.router.gate.": ".mlp.gate.", ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
                   ".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias",
                   ".mlp.shared_mlp.": ".mlp.shared_expert.", ".mlp.shared_experts.": ".mlp.shared_expert."}

    def __init__(self, config: Any, **kwargs):
        if getattr(config, "sliding_window", None):
            raise ValueError(f"HunYuan V3 sliding_window={config.sliding_window} is not supported")
        super().__init__(config, **kwargs)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [None] * config.num_hidden_layers

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        if hy_v3_mlp_types(config)[layer] == "dense":
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bool(getattr(config, "mlp_bias", False)), tp=tp)
        routing = MoERouting(top_k=int(config.num_experts_per_tok), scoring="sigmoid", renormalize=True,
                             renormalize_eps=1e-20, correction_bias=True, router_fp32=True,
                             routed_scaling_factor=float(getattr(config, "router_scaling_factor", 1.0)))
        shared = int(config.moe_intermediate_size) * int(getattr(config, "num_shared_experts", 1) or 0)
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, int(config.num_experts), routing,
                        act=config.hidden_act, shared_intermediate_size=shared, shared_act=config.hidden_act,
                        tp=tp, expert_parallel=self.expert_placement.expert_parallel)

    def _rename(self, name: str) -> str | tuple | None:
        prefix = "model.layers."
        if name.startswith(prefix) and int(name[len(prefix):].split(".", 1)[0]) >= self.config.num_hidden_layers:
            return None  # the multi-token-prediction block (not run)
        return super()._rename(name)
