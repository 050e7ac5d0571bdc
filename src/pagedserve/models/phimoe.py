"""Phi-3.5-MoE (`PhimoeForCausalLM`; Microsoft's checkpoints name it `PhiMoEForCausalLM`):
Mixtral's layers with LayerNorms, biases, sparsemixer routing and LongRoPE.

Differences from Mixtral, as in HF 5.x:
- LayerNorm with a bias (eps `rms_norm_eps`) before the attention, before the experts and at
  the end (`input_layernorm`, `post_attention_layernorm`, `model.norm`);
- `attention_bias`: q / k / v *and* o have biases; `lm_head_bias`: the LM head too, added to the
  logits (`models.base.LMHeadBias`); the embeddings are untied by default;
- the router (`block_sparse_moe.gate`, no bias) routes by sparsemixer (`layers.moe.sparsemixer`,
  `router_jitter_noise` its eps; two experts per token, HF's whatever `num_experts_per_tok` says:
  another value is a ValueError), experts `w1` / `w3` / `w2` gated by `hidden_act`;
  `input_jitter_noise` is training-only;
- RoPE: default, or LongRoPE whose cos/sin factor is `short_mscale` / `long_mscale` (the one of
  the factor set the served context picks: `layers.rotary.RotaryEmbedding`);
- `sliding_window` (when set) on every layer, as HF's mask.
NOTE: the CPU platform's fused decode attention half normalizes with RMSNorm: these layers run
their modules (`fusable_attention = False`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.layers.moe import MoERouting
from pagedserve.layers.norms import LayerNorm
from pagedserve.models.base import LMHeadBias
from pagedserve.models.mixtral import MixtralForCausalLM, MoEDecoderLayer, MoEModel


class PhimoeDecoderLayer(MoEDecoderLayer):
    """Mixtral's pre-norm block with LayerNorms (weight and bias) for its two norms."""

    def __init__(self, config: Any, sliding_window: int | None, mlp: nn.Module, **kwargs):
        super().__init__(config, sliding_window, mlp, **kwargs)
        self.input_layernorm = LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fusable_attention = False  # (see the module docstring)


class PhimoeModel(MoEModel):
    """Mixtral's stack with Phi-3.5-MoE's layers and a final LayerNorm."""

    layer_class = PhimoeDecoderLayer

    def __init__(self, config: Any, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.norm = LayerNorm(config.hidden_size, eps=config.rms_norm_eps)


class PhimoeForCausalLM(LMHeadBias, MixtralForCausalLM):
    """Phi-3.5-MoE decoder-only LM on a paged KV cache (see the module docstring): Mixtral's
    experts and checkpoint names, routed by sparsemixer."""

    model_class = PhimoeModel

    def __init__(self, config: Any, **kwargs):
        super().__init__(config, **kwargs)
        self.init_lm_head_bias(config.vocab_size, bool(getattr(config, "lm_head_bias", False)))

    def routing(self, config: Any) -> MoERouting:
        return MoERouting(top_k=int(config.num_experts_per_tok), scoring="sparsemixer",
                          jitter_eps=float(getattr(config, "router_jitter_noise", 0.01)))


class PhiMoEForCausalLM(PhimoeForCausalLM):
    """The same model under Microsoft's name, which its checkpoints' config.json `architectures`
    carries (`microsoft/Phi-3.5-MoE-instruct`; HF's `model_type` "phimoe" reads it)."""
