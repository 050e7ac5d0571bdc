"""EXAONE MoE (`ExaoneMoeForCausalLM`, LG AI Research's K-EXAONE): EXAONE 4.0's attention in a
pre-norm Llama block, with DeepSeek-V3's mixture of experts.

As in HF 5.x:
- attention: per-head q / k RMSNorm before RoPE; with `sliding_window` set, the `layer_types`
  "sliding_attention" layers attend within the window and apply RoPE, the "full_attention" ones
  attend everywhere with no position embedding (NoPE: the identity rotation, as EXAONE 4.0's,
  `models.exaone4`); without it every layer is global with RoPE;
- pre-norms (`input_layernorm`, `post_attention_layernorm` before the MLP), unlike EXAONE 4.0's
  post-norms;
- feed-forward: a dense gated MLP on the `mlp_layer_types` "dense" layers (HF's default: the
  first `first_k_dense_replace`), elsewhere a `FusedMoE` routed as DeepSeek-V3's (sigmoid
  scores, the selection-only `e_score_correction_bias`, grouped top-k by the sum of each group's
  best two, `norm_topk_prob` (+1e-20), `routed_scaling_factor`; the router in float32) beside
  `num_shared_experts` shared experts as one plain MLP (`mlp.shared_experts`, ours
  `mlp.shared_expert`);
- the checkpoints' multi-token-prediction weights (`mtp.*`) are not run (HF ignores them) and
  not loaded.
llama.cpp writes it as architecture "exaone-moe" (`models.gguf_arch_config`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagedserve.distributed.tp import TPContext
from pagedserve.layers.moe import FusedMoE, MoERouting
from pagedserve.layers.norms import RMSNorm
from pagedserve.models.exaone4 import exaone4_rope_layers
from pagedserve.models.llama import LlamaAttention, LlamaMLP, head_dim_of, layer_sliding_windows
from pagedserve.models.mixtral import MoECausalLM, MoEModel
from pagedserve.models.smollm3 import identity_rope_for


class ExaoneMoeModel(MoEModel):
    """The MoE stack; the global layers of a hybrid model get identity cos/sin tables."""

    def __init__(self, config: Any, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.use_rope = exaone4_rope_layers(config)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x, extras = super().embed(input_ids, positions)  # [T, H]
        return x, identity_rope_for(extras, self.use_rope)


def exaone_moe_layers(config: Any) -> list[bool]:
    """Whether each layer is a mixture of experts (`mlp_layer_types` "sparse", else past the
    first `first_k_dense_replace`)."""
    types = getattr(config, "mlp_layer_types", None)
    n = config.num_hidden_layers
    if types is None:
        return [i >= int(getattr(config, "first_k_dense_replace", 0) or 0) for i in range(n)]
    if len(types) != n:
        raise ValueError(f"config.mlp_layer_types has {len(types)} entries for {n} layers")
    if unknown := set(types) - {"dense", "sparse"}:
        raise ValueError(f"unsupported mlp_layer_types {sorted(unknown)}; supported: dense, sparse")
    return [t == "sparse" for t in types]


class ExaoneMoeForCausalLM(MoECausalLM):
    """EXAONE MoE decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = ExaoneMoeModel
    moe_aliases = {".mlp.shared_experts.": ".mlp.shared_expert.",
                   ".mlp.e_score_correction_bias": ".mlp.gate.e_score_correction_bias"}  # (as released)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        if getattr(config, "sliding_window", None) is None:
            return [None] * config.num_hidden_layers
        return layer_sliding_windows(config)

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module]:
        head_dim, eps = head_dim_of(config), config.rms_norm_eps
        windows = self.sliding_windows(config)
        return lambda i: LlamaAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            scale=head_dim**-0.5, sliding_window=windows[i], qk_norm=lambda d: RMSNorm(d, eps), tp=tp)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        if not exaone_moe_layers(config)[layer]:
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        routing = MoERouting.from_config(config, scoring="sigmoid", topk_method="noaux_tc", router_fp32=True)
        shared = int(getattr(config, "num_shared_experts", 0) or 0) * config.moe_intermediate_size
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, int(config.num_experts), routing,
                        act=config.hidden_act, shared_intermediate_size=shared, shared_act=config.hidden_act,
                        tp=tp, expert_parallel=self.expert_placement.expert_parallel)

    def _rename(self, name: str) -> str | tuple | None:
        if name.startswith(("mtp.", "model.mtp.")):
            return None  # the multi-token-prediction module (see the module docstring)
        return super()._rename(name)


class ExaoneMoEForCausalLM(ExaoneMoeForCausalLM):
    """The same model under the class name K-EXAONE's configs used before transformers 5.1
    (`ExaoneMoEForCausalLM`)."""
