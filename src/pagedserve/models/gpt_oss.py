"""gpt-oss (`GptOssForCausalLM`): OpenAI's open-weight mixture-of-experts models.

As HF's `GptOssForCausalLM`, per layer:
- attention with q/k/v/o biases, grouped KV heads, rotate-half RoPE (YaRN: `layers.rotary`),
  sliding-window attention on the layers `layer_types` marks "sliding_attention" (alternating
  with full attention), and a learned *sink* logit per query head in every softmax's
  denominator (`self_attn.sinks`, passed to the attention call: `layers.attention`);
- a mixture-of-experts feed-forward (`layers.moe.FusedMoE`): the router is a linear layer with a
  bias whose top-k *logits* pick the experts, weighted by the softmax over those k; each expert
  is a clamped SwiGLU with biases: `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`,
  `(up + 1) * gate * sigmoid(alpha * gate)` (alpha 1.702, limit 7.0 by default);
- RMSNorms whose weight multiplies in float32 (`layers.norms.Fp32WeightRMSNorm`).

Checkpoints store the experts stacked: `experts.gate_up_proj` `[E, H, 2I]` with gate and up
*interleaved* along the last dim (gate = even columns), `experts.down_proj` `[E, I, H]`, and
their biases -- or, as OpenAI ships them, MXFP4: `experts.gate_up_proj_blocks` `[E, 2I, H / 32,
16]` + `_scales` `[E, 2I, H / 32]` (and `down_proj_blocks` / `_scales`), which load as MXFP4
blocks without a float copy (`layers.mxfp4`). `load_weights` maps both onto the MoE layer's
`gate_proj` / `up_proj` `[E, I, H]` and `down_proj` `[E, H, I]`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import ShardSpec, VocabParallelEmbedding, set_shard
from pagedserve.layers.norms import Fp32WeightRMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, norm_and_rotate, rope_parameters
from pagedserve.models.base import DecoderStack, KVCache, PagedCausalLM
from pagedserve.models.llama import LlamaAttention, head_dim_of, layer_sliding_windows
from pagedserve.platforms import OpsUser


class ClampedSwiGLU(OpsUser, nn.Module):
    """gpt-oss's expert activation `(gate, up) -> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha
    * g)` with `g = min(gate, limit)`, computed in the activations' dtype as HF's, the sigmoid on
    the platform's one-formula kernel (`layers.moe.invariant_sigmoid`: torch's CPU sigmoid gives a
    tensor's last few elements other bits, so a token's would depend on its batch).
    `moe_kernel_act`: what the CPU platform's MoE kernel (kernels/cpu_moe.py) computes in its
    place, bit for bit."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = float(alpha), float(limit)
        self.moe_kernel_act = ("clamped_swiglu", self.alpha, self.limit)

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:  # [n, I] x 2 -> [n, I]
        from pagedserve.layers.moe import invariant_sigmoid

        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * invariant_sigmoid(gate * self.alpha, self.ops))

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


def clamped_swiglu(alpha: float, limit: float) -> ClampedSwiGLU:
    """gpt-oss's expert activation (`ClampedSwiGLU`)."""
    return ClampedSwiGLU(alpha, limit)


class GptOssAttention(LlamaAttention):
    """Llama attention with q/k/v/o biases and per-head sink logits (`sinks` `[Hq]`, this rank's
    heads), given to the attention call."""

    def __init__(self, config: Any, sliding_window: int | None, *, tp: TPContext = SINGLE):
        head_dim = head_dim_of(config)
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                         head_dim, scale=head_dim**-0.5, sliding_window=sliding_window,
                         qkv_bias=getattr(config, "attention_bias", True),
                         o_bias=getattr(config, "attention_bias", True), tp=tp)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))
        if tp.is_parallel:
            start = tp.rank * self.num_heads
            set_shard(self.sinks, ShardSpec(0, ((start, start + self.num_heads),), config.num_attention_heads))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = norm_and_rotate(q, k, *rope, None, None, self.ops)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, sinks=self.sinks))  # [T, H]


def gpt_oss_moe(config: Any, *, tp: TPContext = SINGLE, expert_parallel: bool = False) -> nn.Module:
    """The MoE block of a gpt-oss layer (`layers.moe.FusedMoE`): router with bias, softmax over
    the top-k logits, clamped-SwiGLU experts with biases."""
    from pagedserve.layers.moe import FusedMoE, MoERouting

    routing = MoERouting(top_k=int(config.num_experts_per_tok), scoring="softmax_topk", router_bias=True)
    act = clamped_swiglu(float(getattr(config, "swiglu_alpha", 1.702)),
                         float(getattr(config, "swiglu_limit", 7.0)))
    return FusedMoE(config.hidden_size, config.intermediate_size, config.num_local_experts, routing,
                    act=act, expert_bias=True, tp=tp, expert_parallel=expert_parallel)


class GptOssDecoderLayer(OpsUser, nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + moe(norm(x)). A decode step's attention half
    may run as one call of the platform (`self.ops.decoder_attention`: on CPU the fused decode
    kernel's attention half with the sinks, bit-identical to the modules), then the MoE block."""

    def __init__(self, config: Any, sliding_window: int | None, *, tp: TPContext = SINGLE):
        super().__init__()
        self.self_attn = GptOssAttention(config, sliding_window, tp=tp)
        self.mlp = gpt_oss_moe(config, tp=tp,
                               expert_parallel=bool(getattr(config, "enable_expert_parallel", False)))
        self.input_layernorm = Fp32WeightRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Fp32WeightRMSNorm(config.hidden_size, config.rms_norm_eps)

    def layer_norms(self) -> tuple:
        """(input, post-attention, pre-feedforward, post-feedforward) norms, as
        `models.llama.FusableDecoderLayer` names them (for the fused attention half)."""
        return (self.input_layernorm, self.post_attention_layernorm, None, None)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        fused = self.ops.decoder_attention(self, x, rope, kv_cache, meta)
        if fused is not None:
            r, h = fused  # [T, H] x + attention, its post-attention norm
            return r + self.mlp(h)
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssModel(DecoderStack):
    """Embeddings, decoder layers (alternating sliding-window / full attention), final norm."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(GptOssDecoderLayer(config, w, tp=tp)
                                    for w in layer_sliding_windows(config))
        self.norm = Fp32WeightRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_parameters(config),
                                          config.max_position_embeddings)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary_emb(positions, x.dtype)  # 2 x [T, D]
        return x, [(rope,)] * len(self.layers)

    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.norm(x)


class GptOssForCausalLM(PagedCausalLM):
    """gpt-oss on a paged KV cache (see `pagedserve.models.base.CausalLM`)."""

    tied_by_default = False

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.model = GptOssModel(config, tp=tp)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=head_dim_of(config), tp=tp)
        # Every layer adds its sink logits: `sinks=True` on each layer's spec (sliding or full).
        # NOTE: sinks are no memory rule (core/kv_spec.py): the sliding layers form one group
        # and the full layers another, as without sinks.
        spec = self.kv_cache_spec
        self.kv_cache_spec = dataclasses.replace(spec, layers=tuple(
            dataclasses.replace(s, sinks=True) for s in spec.layer_specs()))

    def backbone(self) -> nn.Module:
        return self.model

    def _rename(self, name: str) -> str | tuple | None:
        name = super()._rename(name.replace(".mlp.router.", ".mlp.gate."))
        if name is None:
            return None
        from pagedserve.layers.moe import expert_param_name

        return expert_param_name(name, self.model.layers[0].mlp.placement)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF gpt-oss checkpoint tensors (dense or MXFP4 experts, see the module docstring)."""
        from pagedserve.layers.quantization import quantized_available
        from pagedserve.layers.mxfp4 import gpt_oss_expert_weights

        # MXFP4 experts stay blocks where the CPU kernel can multiply them (a CPU model on one
        # rank: `layers.quantization.can_quantize`, else `load_named_weights` dequantizes them),
        # and are dequantized while loading where the kernels are unavailable.
        super().load_weights(gpt_oss_expert_weights(weights, keep_blocks=quantized_available()))
