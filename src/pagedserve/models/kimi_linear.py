"""Kimi Linear (`KimiLinearForCausalLM`, Moonshot Kimi-Linear-48B-A3B): Kimi Delta Attention
layers and multi-head latent attention layers, each followed by a dense SwiGLU MLP or a
DeepSeek-V3-style mixture of experts.

As HF 5.x:
- `config.layer_types[i]` is "linear_attention" (`layers.kimi_delta_attention`: the gated delta
  rule with a per-key-channel decay, its state in cache entries) or "full_attention" (DeepSeek's
  MLA, `layers.mla.MLAttention`, with NO positional encoding at all: the rope part of q and of
  the shared key pass as they are, the identity rotation bit for bit; softmax scale
  `qk_head_dim ** -0.5`);
- `config.mlp_layer_types[i]` is "dense" (SwiGLU of `intermediate_size`) or "sparse": sigmoid
  routing over `num_experts` with the selection-only correction bias, grouped top-k,
  renormalized, times `routed_scaling_factor` (`models.deepseek_v2.deepseek_routing`), plus
  `num_shared_experts` shared experts;
- pre-norm layers, a final RMSNorm; the checkpoint's `block_sparse_moe.*` (experts `w1` / `w3` /
  `w2`) map onto our `mlp.*`.

The cache: one latent entry per MLA layer (`MLASpec`) and a KDA layer's state entries in that
page shape (`RecurrentStateSpec(1, latent, num_tensors=1)`: the pool's blocks are one size).
Tensor parallelism is refused (the delta attention is not split yet).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from pagedserve.core.kv_spec import MLASpec, RecurrentStateSpec
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.kimi_delta_attention import KimiDeltaAttention
from pagedserve.layers.linear import VocabParallelEmbedding
from pagedserve.layers.mla import MLAttention
from pagedserve.layers.moe import ExpertPlacement, FusedMoE, expert_param_name
from pagedserve.layers.norms import RMSNorm
from pagedserve.models.base import CacheEntryStack, KVCacheSpec, PagedCausalLM
from pagedserve.models.deepseek_v2 import deepseek_routing
from pagedserve.models.llama import LlamaMLP

LINEAR, FULL = "linear_attention", "full_attention"


def kimi_layer_types(config: Any) -> tuple[list[str], list[bool]]:
    """Each layer's mixer kind (`layer_types`) and whether its feed-forward is sparse
    (`mlp_layer_types`); ValueError on an unknown kind or a count that is not the layers'."""
    n = config.num_hidden_layers
    kinds = list(getattr(config, "layer_types", None) or [])
    mlps = list(getattr(config, "mlp_layer_types", None) or [])
    if len(kinds) != n or len(mlps) != n:
        raise ValueError(f"config.layer_types / mlp_layer_types have {len(kinds)} / {len(mlps)} entries "
                         f"for {n} layers")
    if unknown := sorted(set(kinds) - {LINEAR, FULL}):
        raise ValueError(f"config.layer_types: unsupported layer type(s) {unknown}")
    if unknown := sorted(set(mlps) - {"dense", "sparse"}):
        raise ValueError(f"config.mlp_layer_types: unsupported type(s) {unknown}")
    return kinds, [m == "sparse" for m in mlps]


class KimiLinearDecoderLayer(nn.Module):
    """`x + self_attn(norm(x))` (KDA with its cache entries, or MLA with identity rope tables and
    one entry), then `x + mlp(norm(x))`."""

    def __init__(self, config: Any, kind: str, sparse: bool, page: int, placement: ExpertPlacement):
        super().__init__()
        self.kind, eps = kind, config.rms_norm_eps
        if kind == LINEAR:
            self.self_attn = KimiDeltaAttention(
                config.hidden_size, num_heads=int(config.linear_num_heads),
                head_dim=int(config.linear_head_dim), conv_kernel=int(config.linear_conv_kernel_dim),
                act=config.hidden_act, eps=eps, page=page, tensors=1)
        else:
            self.self_attn = MLAttention(
                config.hidden_size, config.num_attention_heads, q_lora_rank=config.q_lora_rank,
                kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_nope_head_dim,
                qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
                scale=(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5,
                bias=bool(getattr(config, "attention_bias", False)), eps=eps)
        if sparse:
            shared = int(getattr(config, "n_shared_experts", 0) or 0) * config.moe_intermediate_size
            self.mlp = FusedMoE(config.hidden_size, config.moe_intermediate_size, placement.num_experts,
                                deepseek_routing(config, v3=True), act=config.hidden_act,
                                shared_intermediate_size=shared, shared_act=config.hidden_act)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, *mixer_inputs) -> torch.Tensor:  # [T, H] -> [T, H]
        x = x + self.self_attn(self.input_layernorm(x), *mixer_inputs)
        return x + self.mlp(self.post_attention_layernorm(x))


class KimiLinearModel(CacheEntryStack):
    """Embeddings, layers, final norm; each layer reads its own cache entries
    (`cache_entries_of`, rebuilt by `map_entries` when the states are bound anew)."""

    one_entry_kinds = (FULL,)

    def __init__(self, config: Any, placement: ExpertPlacement):
        super().__init__()
        self.layer_types, sparse = kimi_layer_types(config)
        self.latent = config.kv_lora_rank + config.qk_rope_head_dim  # the page: one latent a token
        self.rope_dim = config.qk_rope_head_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KimiLinearDecoderLayer(config, kind, s, self.latent, placement)
                                    for kind, s in zip(self.layer_types, sparse))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.map_entries()

    def map_entries(self) -> None:
        """Layer i's cache entries: one per MLA layer, `num_entries` per KDA layer."""
        counts = [layer.self_attn.num_entries if kind == LINEAR else 1
                  for layer, kind in zip(self.layers, self.layer_types)]
        starts = list(itertools.accumulate([0] + counts))
        self.cache_entries_of = [list(range(a, a + n)) for a, n in zip(starts, counts)]

    def cache_specs(self) -> tuple:
        """One `core.kv_spec` spec per cache entry, all of the latent's page shape."""
        specs = []
        for kind, entries in zip(self.layer_types, self.cache_entries_of):
            spec = MLASpec(self.latent) if kind == FULL else RecurrentStateSpec(1, self.latent, num_tensors=1)
            specs += [spec] * len(entries)
        return tuple(specs)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        # no positional encoding: the identity rotation of the rope dims, bit for bit
        cos = torch.ones(len(positions), self.rope_dim, dtype=x.dtype, device=x.device)  # [T, R]
        rope = (cos, torch.zeros_like(cos))
        return x, [(rope,) if kind == FULL else () for kind in self.layer_types]

    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.norm(x)


class KimiLinearForCausalLM(PagedCausalLM):
    """Kimi Linear decoder-only LM on a paged cache (see the module docstring). Pipeline stages
    refuse it (its cache entries are not its layers)."""

    tied_by_default = False

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        if tp.is_parallel:
            raise ValueError("tensor_parallel_size > 1: Kimi Linear's delta attention is not split over "
                             "ranks yet; serve it on one rank")
        experts = int(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0) or 0)
        self.expert_placement = ExpertPlacement(max(experts, 1), tp, False)
        self.model = KimiLinearModel(config, self.expert_placement)
        latent = self.model.latent
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size, num_kv_heads=1,
                        head_dim=latent, tp=tp)
        self.bind_cache(16, torch.float32)

    def backbone(self) -> nn.Module:
        return self.model

    def bind_cache(self, block_size: int, cache_dtype: torch.dtype) -> None:
        """Fit every KDA layer's state to the cache's blocks, then map the layers onto the cache
        entries and declare them (`kv_cache_spec`)."""
        for layer in self.model.layers:
            if layer.kind == LINEAR:
                layer.self_attn.bind(block_size, cache_dtype)
        self.model.map_entries()
        specs = self.model.cache_specs()
        self.kv_cache_spec = KVCacheSpec(len(specs), 1, self.model.latent, specs)

    def _rename(self, name: str) -> str | tuple | None:
        name = name.replace(".block_sparse_moe.shared_experts.", ".mlp.shared_expert.")
        name = super()._rename(name.replace(".block_sparse_moe.", ".mlp."))
        return None if name is None else expert_param_name(name, self.expert_placement)
