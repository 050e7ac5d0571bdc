"""Granite 3.x MoE (`GraniteMoeForCausalLM`, and `GraniteMoeSharedForCausalLM` with its shared
MLP): Granite's four multipliers (`models.granite`) around Mixtral-style layers.

Differences from Mixtral, as in HF 5.x:
- the router (`block_sparse_moe.router.layer`) picks the top-k *logits* and weighs the chosen
  experts by the softmax over those k alone (`MoERouting` scoring "softmax_topk", as gpt-oss);
- the checkpoint stacks each layer's experts as `block_sparse_moe.input_linear` `[E, 2I, H]`
  (gate rows, then up rows) and `block_sparse_moe.output_linear` `[E, H, I]`, split at load into
  the MoE layer's `experts.gate_proj` / `up_proj` / `down_proj`;
- GraniteMoeShared adds `shared_mlp` (`input_linear` `[2 S, H]`, `output_linear` `[H, S]`), a
  plain gated MLP beside the experts (`FusedMoE`'s shared expert, without a gate);
- embeddings times `embedding_multiplier`, each residual branch times `residual_multiplier`,
  `attention_multiplier` as the attention scale, logits divided by `logits_scaling`.
NOTE: the fused decode attention half adds its branch unscaled: layers with a residual
multiplier != 1 run their modules.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import TPContext
from pagedserve.layers.moe import FusedMoE, MoERouting
from pagedserve.layers.weights import read_full, split_rows
from pagedserve.models.base import KVCache
from pagedserve.models.granite import EmbeddingMultiplier, LogitsScaling
from pagedserve.models.mixtral import MoECausalLM, MoEDecoderLayer, MoEModel


def granite_moe_block(config: Any, tp: TPContext, expert_parallel: bool) -> FusedMoE:
    """A Granite MoE layer's experts (`num_local_experts`) and, with `shared_intermediate_size`,
    its shared MLP: HF's router takes the top-k of the logits and weighs them by the softmax
    over those k (no renormalization needed)."""
    routing = MoERouting(top_k=int(config.num_experts_per_tok), scoring="softmax_topk")
    return FusedMoE(config.hidden_size, config.intermediate_size, int(config.num_local_experts), routing,
                    act=config.hidden_act,
                    shared_intermediate_size=int(getattr(config, "shared_intermediate_size", 0) or 0),
                    shared_act=config.hidden_act, tp=tp, expert_parallel=expert_parallel)


def split_granite_moe(pairs: Iterable[tuple[str, Any]], inter: int,
                      shared: int) -> Iterator[tuple[str, Any]]:
    """Granite's fused checkpoint tensors split into ours (see the module docstring): each
    layer's `block_sparse_moe.input_linear` `[E, 2 inter, H]` into `experts.gate_proj` /
    `up_proj`, `output_linear` into `experts.down_proj`; `shared_mlp.input_linear` `[2 shared,
    H]` into `gate_proj` / `up_proj`, `output_linear` into `down_proj` (Granite 4.0-H too)."""
    for name, source in pairs:
        if name.endswith(".block_sparse_moe.input_linear.weight"):
            t = read_full(source)  # [E, 2I, H]: gate rows, then up rows
            if t.dim() != 3 or t.shape[1] != 2 * inter:
                raise ValueError(f"{name}: expected [experts, 2 * {inter}, hidden], got {tuple(t.shape)}")
            stem = name[: -len("input_linear.weight")]
            yield f"{stem}experts.gate_proj.weight", t[:, :inter]
            yield f"{stem}experts.up_proj.weight", t[:, inter:]
        elif name.endswith(".block_sparse_moe.output_linear.weight"):
            yield name[: -len("output_linear.weight")] + "experts.down_proj.weight", source
        elif name.endswith(".shared_mlp.input_linear.weight"):
            stem = name[: -len("input_linear.weight")]
            gate, up = split_rows(source, [shared, shared])
            yield f"{stem}gate_proj.weight", gate
            yield f"{stem}up_proj.weight", up
        elif name.endswith(".shared_mlp.output_linear.weight"):
            yield name[: -len("output_linear.weight")] + "down_proj.weight", source
        else:
            yield name, source


class GraniteMoeDecoderLayer(MoEDecoderLayer):
    """Mixtral's pre-norm block with `residual_multiplier` on both branches and
    `attention_multiplier` as the attention scale."""

    def __init__(self, config: Any, sliding_window: int | None, mlp: nn.Module, **kwargs):
        super().__init__(config, sliding_window, mlp, **kwargs)
        self.self_attn.attn.scale = float(config.attention_multiplier)
        self.residual_multiplier = float(config.residual_multiplier)
        if self.residual_multiplier != 1.0:  # (see the module docstring)
            self.fusable_attention = False

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        m = self.residual_multiplier
        if m == 1.0:
            return super().forward(x, rope, kv_cache, meta)
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta) * m
        return x + self.mlp(self.post_attention_layernorm(x)) * m


class GraniteMoeModel(EmbeddingMultiplier, MoEModel):
    """Mixtral's stack with Granite's layers and the embedding multiplier."""

    layer_class = GraniteMoeDecoderLayer


class GraniteMoeForCausalLM(LogitsScaling, MoECausalLM):
    """Granite MoE decoder-only LM on a paged KV cache (see the module docstring); also serves
    `GraniteMoeSharedForCausalLM` (`shared_intermediate_size` > 0)."""

    model_class = GraniteMoeModel
    moe_aliases = {".block_sparse_moe.router.layer.": ".mlp.gate.", ".block_sparse_moe.": ".mlp.",
                   ".shared_mlp.": ".mlp.shared_expert."}

    def __init__(self, config: Any, **kwargs):
        super().__init__(config, **kwargs)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))

    @staticmethod
    def num_experts(config: Any) -> int:
        return int(config.num_local_experts)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [None] * config.num_hidden_layers

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        return granite_moe_block(config, tp, self.expert_placement.expert_parallel)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF Granite MoE checkpoint tensors, the fused ones split (see the module docstring)."""
        shared = int(getattr(self.config, "shared_intermediate_size", 0) or 0)
        super().load_weights(split_granite_moe(weights, int(self.config.intermediate_size), shared))


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE with a shared MLP beside the experts (`shared_intermediate_size`)."""
