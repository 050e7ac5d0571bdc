"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, model type `glm4_moe_lite`): DeepSeek-V3's
multi-head latent attention with GLM-4.5's mixture of experts.

As in HF 5.x (`Glm4MoeLiteModel`: `DeepseekV3Attention` in `Glm4MoeDecoderLayer`s):
- attention: MLA (`models.deepseek_v2`; the paged cache holds one latent row of `kv_lora_rank +
  qk_rope_head_dim` per token), RoPE over the whole `qk_rope_head_dim` in DeepSeek's interleaved
  pairs (`rope_interleave`, the default) or rotate-half, the softmax scale with YaRN's mscale when
  the rope is scaled;
- feed-forward: a dense gated MLP where `mlp_layer_types` says "dense" (HF's default: the first
  layer), otherwise DeepSeek-V3's routing (sigmoid scores, the selection-only
  `e_score_correction_bias`, grouped top-k, `norm_topk_prob`, `routed_scaling_factor`) beside
  `n_shared_experts` shared ones;
- the checkpoints' multi-token-prediction layer (`model.layers.<num_hidden_layers>`) is skipped,
  as HF skips it.
llama.cpp writes these checkpoints as "deepseek2" GGUFs (conversion/glm.py's
`Glm4MoeLiteModel`): they load as DeepSeek V3 (`models.gguf_families`), the same computation.
"""

from __future__ import annotations

from typing import Any

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.rotary import rope_parameters
from pagedserve.models.deepseek_v2 import DeepseekV3ForCausalLM


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash on a paged latent cache: DeepSeek V3's model with the MoE layers named by
    `mlp_layer_types` (`models.deepseek_v2.is_moe_layer`; see the module docstring)."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        partial = rope_parameters(config).get("partial_rotary_factor", 1.0)
        if partial != 1.0:  # HF rotates the whole rope part (its cos/sin would not fit q otherwise)
            raise ValueError(f"Glm4MoeLite: partial_rotary_factor {partial} is not supported (only 1.0)")
        types = getattr(config, "mlp_layer_types", None)
        if types is not None and (len(types) != config.num_hidden_layers
                                  or set(types) - {"dense", "sparse"}):
            raise ValueError(f"Glm4MoeLite: mlp_layer_types {types!r} is not one of 'dense' / 'sparse' "
                             f"per layer ({config.num_hidden_layers} layers)")
        super().__init__(config, tp=tp)
