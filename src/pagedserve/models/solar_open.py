"""Solar Open (`SolarOpenForCausalLM`, Upstage's Solar-Open-100B): Llama's attention with GLM-4.5's
mixture of experts in every layer.

As in HF 5.x (`SolarOpenModel` over GLM-4.5 MoE's stack): q / k / v with biases with
`attention_bias` (o_proj none), no q / k norms, whole-head RoPE (a `partial_rotary_factor` in
the rope parameters is honoured as GLM-4.5's); every layer a `FusedMoE` routed as DeepSeek-V3's
(sigmoid scores chosen with the correction bias, grouped top-k, `norm_topk_prob`,
`routed_scaling_factor`; the router in float32) beside `n_shared_experts` shared experts -- GLM-4.5
MoE's model (`models.glm4_moe`) with no dense first layers. llama.cpp writes it as GLM-4.5 MoE
("glm4moe"), which loads as `Glm4MoeForCausalLM`: the same computation.
"""

from __future__ import annotations

from pagedserve.models.glm4_moe import Glm4MoeForCausalLM


class SolarOpenForCausalLM(Glm4MoeForCausalLM):
    """Solar Open decoder-only LM on a paged KV cache (see the module docstring): GLM-4.5 MoE's
    model, whose config has no `first_k_dense_replace` (every layer has experts) nor
    `use_qk_norm` (none)."""
