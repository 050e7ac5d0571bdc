"""Cohere 2 MoE (`Cohere2MoeForCausalLM`): Cohere 2's parallel block (`models.cohere2`) with a
mixture of experts as its MLP.

As in HF 5.x:
- the block: `x + attn(norm(x)) + mlp(norm(x))`, its norm (and the final one) an RMSNorm when
  the config sets `rms_norm_eps`, else Cohere's LayerNorm (`layer_norm_eps`);
- attention: Cohere's (q / k / v / o biases with `attention_bias`, RoPE on interleaved pairs in
  float32, no q / k norms); the `layer_types` "sliding_attention" layers attend within
  `sliding_window` and rotate, the full ones see no positions -- except the dense prefix layers
  when `prefix_dense_sliding_window_pattern` is 1 (HF's `force_rope`: full attention with RoPE);
- feed-forward: a dense gated MLP (`prefix_dense_intermediate_size`, else `intermediate_size`) on
  the `mlp_layer_types` "dense" layers; elsewhere `num_experts` experts of `intermediate_size`:
  the top-k router *logits* chosen, weighed by their softmax (`expert_selection_fn` "softmax") or
  their sigmoids (renormalized with `norm_topk_prob`); `num_shared_experts` shared experts as one
  plain MLP (`mlp.shared_experts`, ours `mlp.shared_expert`) whose output is added to the
  routed one ("sum") or averaged with it ("average", HF's default);
- logits times `logit_scale`; tied embeddings by default.
llama.cpp writes it as architecture "cohere2moe" (`models.gguf_arch_config`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.moe import FusedMoE, MoERouting, invariant_sigmoid, select_experts
from pagedserve.layers.norms import RMSNorm
from pagedserve.models.base import KVCache
from pagedserve.models.cohere import CohereAttention, CohereLayerNorm, check_cohere_config
from pagedserve.models.cohere2 import cohere2_layer_types
from pagedserve.models.granite import LogitsScaling
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.mixtral import MoECausalLM, MoEModel

SELECTIONS = ("softmax", "sigmoid")
COMBINATIONS = ("sum", "average")


def cohere2_moe_norm(config: Any) -> nn.Module:
    """The block's (and the final) norm: RMSNorm with `rms_norm_eps`, else Cohere's LayerNorm."""
    if getattr(config, "rms_norm_eps", None) is not None:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)
    return CohereLayerNorm(config.hidden_size, config.layer_norm_eps)


def cohere2_moe_dense_layers(config: Any) -> list[bool]:
    """Whether each layer's MLP is dense (`mlp_layer_types` "dense"; none without the list)."""
    types = getattr(config, "mlp_layer_types", None) or ["sparse"] * config.num_hidden_layers
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"config.mlp_layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    if unknown := set(types) - {"dense", "sparse"}:
        raise ValueError(f"unsupported mlp_layer_types {sorted(unknown)}; supported: dense, sparse")
    return [t == "dense" for t in types]


class Cohere2MoeBlock(FusedMoE):
    """`FusedMoE` whose shared expert's output is added to the routed one or averaged with it
    (`combination`: HF's `shared_expert_combination_strategy`)."""

    def __init__(self, *args, combination: str = "sum", **kwargs):
        super().__init__(*args, **kwargs)
        if combination not in COMBINATIONS:
            raise ValueError(f"unsupported shared_expert_combination_strategy {combination!r}; "
                             f"supported: {', '.join(COMBINATIONS)}")
        self.combination = combination

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if self.shared_expert is None or self.combination == "sum":
            return super().forward(x)
        weights, ids = select_experts(self.gate(x), self.routing, None, lambda v: invariant_sigmoid(v, self.ops))
        y = self.experts(x, weights, ids, down_bias=self.tp.rank == 0)  # [T, H] fp32
        y = self.tp.all_reduce(y + self.shared_expert(x).float())  # summed in float32 over the ranks
        return (y / 2).to(x.dtype)  # HF's (routed + shared) / 2


class Cohere2MoeDecoderLayer(nn.Module):
    """Cohere's parallel block over the layer's attention and feed-forward (dense or experts)."""

    def __init__(self, config: Any, sliding_window: int | None, mlp: nn.Module, *, qkv_bias: bool,
                 qk_norm: bool, attention: nn.Module | None = None, tp: TPContext = SINGLE):
        super().__init__()
        if attention is None:
            raise ValueError("Cohere2MoeDecoderLayer needs its attention module")
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = cohere2_moe_norm(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        h = self.input_layernorm(x)  # [T, H]
        return x + self.self_attn(h, rope, kv_cache, meta) + self.mlp(h)  # HF's order of the sums


class Cohere2MoeModel(MoEModel):
    """Embeddings, Cohere 2 MoE layers, the final norm; RoPE on interleaved pairs."""

    layer_class = Cohere2MoeDecoderLayer
    rope_interleaved = True

    def __init__(self, config: Any, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.norm = cohere2_moe_norm(config)


class Cohere2MoeForCausalLM(LogitsScaling, MoECausalLM):
    """Cohere 2 MoE decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = Cohere2MoeModel
    tied_by_default = True
    moe_aliases = {".mlp.shared_experts.": ".mlp.shared_expert."}

    def __init__(self, config: Any, **kwargs):
        check_cohere_config(config)
        super().__init__(config, **kwargs)
        scale = getattr(config, "logit_scale", 0.0625)
        self.logit_scale = 1.0 if scale is None else float(scale)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        window = getattr(config, "sliding_window", None)
        return [window if t == "sliding_attention" else None for t in cohere2_layer_types(config)]

    @staticmethod
    def rope_layers(config: Any) -> list[bool]:
        """Whether each layer rotates q and k: the sliding ones, and the dense prefix ones when
        `prefix_dense_sliding_window_pattern` is 1 (HF's `force_rope`)."""
        force = getattr(config, "prefix_dense_sliding_window_pattern", 1) == 1
        dense = cohere2_moe_dense_layers(config)
        windows = Cohere2MoeForCausalLM.sliding_windows(config)
        return [w is not None or (force and d) for w, d in zip(windows, dense)]

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module]:
        windows, rope = self.sliding_windows(config), self.rope_layers(config)
        return lambda i: CohereAttention(config, windows[i], qk_norm=False, use_rope=rope[i], tp=tp)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        if cohere2_moe_dense_layers(config)[layer]:
            width = getattr(config, "prefix_dense_intermediate_size", None) or config.intermediate_size
            return LlamaMLP(config.hidden_size, width, config.hidden_act, tp=tp)
        selection = getattr(config, "expert_selection_fn", "softmax")
        if selection not in SELECTIONS:
            raise ValueError(f"unsupported expert_selection_fn {selection!r}; supported: {', '.join(SELECTIONS)}")
        routing = MoERouting(top_k=int(config.num_experts_per_tok), scoring=f"{selection}_topk",
                             renormalize=selection == "sigmoid" and bool(getattr(config, "norm_topk_prob", False)))
        shared = int(getattr(config, "num_shared_experts", 0) or 0) * config.intermediate_size
        return Cohere2MoeBlock(config.hidden_size, config.intermediate_size, int(config.num_experts), routing,
                               act=config.hidden_act, shared_intermediate_size=shared, shared_act=config.hidden_act,
                               combination=getattr(config, "shared_expert_combination_strategy", "sum"), tp=tp,
                               expert_parallel=self.expert_placement.expert_parallel)
