"""AfMoE (`AfmoeForCausalLM`, Arcee's Trinity models): gated attention over sliding and global
layers, sandwich norms, and DeepSeek-V3-like sigmoid experts beside shared ones.

As in HF 5.x:
- attention: q / k / v (and o) biases with `attention_bias`, per-head q / k RMSNorm, and an
  output gate: `o_proj(attn * sigmoid(gate_proj(x)))` (`gate_proj`: hidden -> heads * head_dim);
  the `layer_types` "sliding_attention" layers attend within `sliding_window` and apply RoPE, the
  "full_attention" ones attend everywhere without any position embedding (NoPE: the identity
  rotation, `models.smollm3.identity_rope_for`);
- each branch between two norms: `x + post_attention_layernorm(attn(input_layernorm(x)))`, then
  `x + post_mlp_layernorm(mlp(pre_mlp_layernorm(x)))`;
- feed-forward: a dense gated MLP (`intermediate_size`) in the first `num_dense_layers` layers,
  then a `FusedMoE`: sigmoid scores, the top-k chosen with the selection-only `expert_bias`
  (HF's `mlp.expert_bias`, ours `mlp.gate.e_score_correction_bias`), the chosen scores divided
  by their sum + 1e-20, times `route_scale`; the router (`mlp.router.gate`) in the model dtype,
  its logits in float32; `num_shared_experts` shared experts as one plain MLP of
  `num_shared_experts * moe_intermediate_size` (`mlp.shared_experts`, ours `mlp.shared_expert`);
- `mup_enabled`: the embeddings times sqrt(hidden_size).
llama.cpp writes it as architecture "afmoe" (`models.gguf_arch_config`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import ColumnParallelLinear
from pagedserve.layers.moe import FusedMoE, MoERouting, invariant_sigmoid
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.rotary import norm_and_rotate
from pagedserve.models.base import KVCache
from pagedserve.models.llama import LlamaAttention, LlamaMLP, head_dim_of, layer_sliding_windows
from pagedserve.models.mixtral import MoECausalLM, MoEDecoderLayer, MoEModel
from pagedserve.models.smollm3 import identity_rope_for


class AfmoeAttention(LlamaAttention):
    """Llama's attention with per-head q / k norms and a sigmoid output gate per channel:
    `o_proj(attn(q, k, v) * sigmoid(gate_proj(x)))`."""

    def __init__(self, config: Any, sliding_window: int | None, tp: TPContext = SINGLE):
        head_dim, eps = head_dim_of(config), config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                         scale=head_dim**-0.5, sliding_window=sliding_window, qkv_bias=bias, o_bias=bias,
                         qk_norm=lambda d: RMSNorm(d, eps), tp=tp)
        # sharded by whole heads, as q_proj
        self.gate_proj = ColumnParallelLinear(config.hidden_size, config.num_attention_heads * head_dim, False, tp=tp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        q, k, v = self.qkv_heads(x)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        q, k = norm_and_rotate(q, k, *rope, self.q_norm, self.k_norm, self.ops)
        out = self.attn(q, k, v, kv_cache, meta)  # [T, Hq * D]
        out = out * invariant_sigmoid(self.gate_proj(x).contiguous(), self.ops)  # [T, Hq * D]
        return self.o_proj(out)


class AfmoeDecoderLayer(MoEDecoderLayer):
    """Sandwich-norm block: x + post_attn_norm(attn(in_norm(x))), then
    x + post_mlp_norm(mlp(pre_mlp_norm(x))); runs its modules (no fused decode half)."""

    def __init__(self, config: Any, sliding_window: int | None, mlp: nn.Module, *, qkv_bias: bool,
                 qk_norm: bool, attention: nn.Module | None = None, tp: TPContext = SINGLE):
        super().__init__(config, sliding_window, mlp, qkv_bias=qkv_bias, qk_norm=qk_norm,
                         attention=attention, tp=tp)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fusable_attention = False

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return x + self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(x)))


def afmoe_rope_layers(config: Any) -> list[bool]:
    """Whether each layer applies RoPE: the "sliding_attention" layers only (HF's
    `is_local_attention`)."""
    types = list(config.layer_types)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    return [t == "sliding_attention" for t in types]


class AfmoeModel(MoEModel):
    """The stack of AfMoE layers: the embeddings scaled with `mup_enabled`, the global layers
    given the identity rotation."""

    layer_class = AfmoeDecoderLayer

    def __init__(self, config: Any, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.use_rope = afmoe_rope_layers(config)
        self.embed_scale = float(config.hidden_size**0.5) if getattr(config, "mup_enabled", False) else None

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x, extras = super().embed(input_ids, positions)  # [T, H]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        return x, identity_rope_for(extras, self.use_rope)


def afmoe_routing(config: Any) -> MoERouting:
    """AfMoE's router: sigmoid scores, the top-k chosen with the selection bias, renormalized
    (+1e-20), times `route_scale`."""
    return MoERouting(top_k=int(config.num_experts_per_tok), scoring="sigmoid", renormalize=True,
                      renormalize_eps=1e-20, correction_bias=True,
                      routed_scaling_factor=float(getattr(config, "route_scale", None) or 1.0))


class AfmoeForCausalLM(MoECausalLM):
    """AfMoE decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = AfmoeModel
    moe_aliases = {".mlp.router.gate.": ".mlp.gate.", ".mlp.expert_bias": ".mlp.gate.e_score_correction_bias",
                   ".mlp.shared_experts.": ".mlp.shared_expert."}

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return layer_sliding_windows(config)

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module]:
        windows = self.sliding_windows(config)
        return lambda i: AfmoeAttention(config, windows[i], tp=tp)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        if layer < int(getattr(config, "num_dense_layers", 0) or 0):
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        shared = int(getattr(config, "num_shared_experts", 0) or 0) * config.moe_intermediate_size
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, int(config.num_experts),
                        afmoe_routing(config), act=config.hidden_act, shared_intermediate_size=shared,
                        shared_act=config.hidden_act, tp=tp,
                        expert_parallel=self.expert_placement.expert_parallel)
