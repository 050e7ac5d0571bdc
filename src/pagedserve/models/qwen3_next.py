"""Qwen3-Next (`Qwen3NextForCausalLM`): Gated DeltaNet linear-attention layers and gated full
attention layers, a mixture of experts with a sigmoid-gated shared expert.

`config.layer_types[i]` is "linear_attention" (`layers.gated_delta_net.GatedDeltaNet`, its state
in cache entries of `core.kv_spec.RecurrentStateSpec`) or "full_attention" (`GatedAttention`:
q_proj gives each head's query and an output gate, `o_proj(attn * sigmoid(gate))`, per-head q/k
norms, RoPE on the first `partial_rotary_factor` of each head). Every norm is zero-centred
(`1 + weight`: `layers.norms.GemmaRMSNorm`) except the DeltaNet's gated output norm. The
feed-forward is Qwen2-MoE's (`layers.moe.FusedMoE` with a shared expert and `shared_expert_gate`)
where `models.qwen3_moe.is_sparse_layer` says, else a SwiGLU MLP.

The cache has one entry per attention layer and `GatedDeltaNet.num_entries` per linear layer,
which depends on the block size and cache dtype (`bind_cache`); the model maps its layers onto
them (`cache_entries_of`). Checkpoints' fused DeltaNet projections are split at load
(`layers.gated_delta_net.split_fused_projections`); the multi-token-prediction head (`mtp.*`)
is skipped. `models.qwen3_5` reuses all of it.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.kv_spec import FullAttentionSpec, RecurrentStateSpec
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.gated_delta_net import GatedDeltaNet, split_fused_projections
from pagedserve.layers.linear import ColumnParallelLinear, VocabParallelEmbedding, linear_outputs
from pagedserve.layers.moe import ExpertPlacement, FusedMoE, MoERouting, expert_param_name, invariant_sigmoid
from pagedserve.layers.norms import GemmaRMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, norm_and_rotate, rope_parameters
from pagedserve.models.base import CacheEntryStack, KVCache, KVCacheSpec, PagedCausalLM
from pagedserve.models.llama import LlamaAttention, LlamaMLP, head_dim_of
from pagedserve.models.qwen3_moe import is_sparse_layer

LINEAR, FULL = "linear_attention", "full_attention"


def hybrid_layer_types(config: Any) -> list[str]:
    """`config.layer_types`; ValueError on a type we do not know or a count that is not the
    layers'."""
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    if unknown := sorted(set(types) - {LINEAR, FULL}):
        raise ValueError(f"config.layer_types: unsupported layer type(s) {unknown}; supported: "
                         f"{LINEAR!r}, {FULL!r}")
    return types


def text_rope_parameters(config: Any) -> dict:
    """The RoPE parameters, Qwen3.5's M-RoPE keys dropped: with one position for all three
    sections (text) it is the 1D RoPE."""
    params = {k: v for k, v in rope_parameters(config).items()
              if k not in ("mrope_section", "mrope_interleaved")}
    if params["rope_type"] == "mrope":
        params["rope_type"] = "default"
    return params


class GatedAttention(LlamaAttention):
    """Qwen3-Next's attention: `q_proj` gives per head `[query | gate]` (2 x head_dim), the
    attention output is scaled by `sigmoid(gate)` before `o_proj`; zero-centred q/k norms."""

    def __init__(self, config: Any, tp: TPContext = SINGLE):
        head_dim, eps = head_dim_of(config), config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                         head_dim, scale=head_dim**-0.5, qkv_bias=bias, o_bias=bias,
                         qk_norm=lambda d: GemmaRMSNorm(d, eps), tp=tp)
        # per head [query | gate]: whole heads per rank, like the plain q_proj
        self.q_proj = ColumnParallelLinear(config.hidden_size, 2 * config.num_attention_heads * head_dim,
                                          bias, tp=tp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        t, d = x.shape[0], self.head_dim
        qg, k, v = linear_outputs(x, self.fusable_linears()[0])
        q, gate = qg.reshape(t, self.num_heads, 2 * d).split(d, dim=-1)  # [T, Hq, D] each
        k = k.reshape(t, self.num_kv_heads, d)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, d)
        q, k = norm_and_rotate(q.contiguous(), k.contiguous(), *rope, self.q_norm, self.k_norm, self.ops)
        out = self.attn(q, k, v, kv_cache, meta)  # [T, Hq * D]
        out = out * invariant_sigmoid(gate.reshape(t, -1).contiguous(), self.ops)
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    """`x + mixer(norm(x))`, then `x + mlp(norm(x))`; the mixer is `linear_attn` (a
    `GatedDeltaNet`: called with its cache entries and their metadata) or `self_attn` (a
    `GatedAttention`: RoPE tables, one cache entry, its metadata)."""

    def __init__(self, config: Any, kind: str, mlp: nn.Module, page: int, tp: TPContext = SINGLE):
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(
                config.hidden_size, num_k_heads=config.linear_num_key_heads,
                num_v_heads=config.linear_num_value_heads, head_k_dim=config.linear_key_head_dim,
                head_v_dim=config.linear_value_head_dim, conv_kernel=config.linear_conv_kernel_dim,
                act=config.hidden_act, eps=config.rms_norm_eps, page=page, tp=tp,
                tiled=bool(getattr(config, "linear_value_heads_tiled", False)))
        else:
            self.self_attn = GatedAttention(config, tp)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, *mixer_inputs) -> torch.Tensor:  # [T, H] -> [T, H]
        mixer = self.linear_attn if self.kind == LINEAR else self.self_attn
        x = x + mixer(self.input_layernorm(x), *mixer_inputs)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridModel(CacheEntryStack):
    """Embeddings, hybrid layers, final norm; each layer reads its own cache entries
    (`cache_entries_of`, rebuilt by `map_entries` when the states are bound anew).
    `make_mlp(layer_index)` builds a layer's feed-forward block."""

    one_entry_kinds = (FULL,)

    def __init__(self, config: Any, make_mlp, tp: TPContext = SINGLE):
        super().__init__()
        self.layer_types = hybrid_layer_types(config)
        head_dim = head_dim_of(config)
        # K and V values of a token on this rank: a recurrent state's cache entries take that shape
        self.page = 2 * tp.local_kv_heads(config.num_key_value_heads) * head_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, kind, make_mlp(i), self.page, tp)
                                    for i, kind in enumerate(self.layer_types))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim, text_rope_parameters(config),
                                          config.max_position_embeddings)
        self.map_entries()

    def map_entries(self) -> None:
        """Layer i's cache entries: one per attention layer, `num_entries` per linear layer."""
        counts = [layer.linear_attn.num_entries if kind == LINEAR else 1
                  for layer, kind in zip(self.layers, self.layer_types)]
        starts = list(itertools.accumulate([0] + counts))
        self.cache_entries_of = [list(range(a, a + n)) for a, n in zip(starts, counts)]

    def cache_specs(self, num_kv_heads: int, head_dim: int) -> tuple:
        """One `core.kv_spec` spec per cache entry."""
        specs = []
        for kind, entries in zip(self.layer_types, self.cache_entries_of):
            spec = (FullAttentionSpec(num_kv_heads, head_dim) if kind == FULL
                    else RecurrentStateSpec(num_kv_heads, head_dim))
            specs += [spec] * len(entries)
        return tuple(specs)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary_emb(positions, x.dtype)  # 2 x [T, R]
        return x, [(rope,) if kind == FULL else () for kind in self.layer_types]

    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.norm(x)


class Qwen3NextForCausalLM(PagedCausalLM):
    """Qwen3-Next decoder-only LM on a paged cache (see the module docstring); `tp` makes it
    this rank's shard (heads, linear-attention heads, experts or their slices). Pipeline stages
    refuse it (its cache entries are not its layers: worker/pp_executor.py)."""

    tied_by_default = False

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.text_config = config  # (a multimodal wrapper's `config` is the whole one)
        experts = int(getattr(config, "num_experts", 0) or 0)
        self.expert_placement = ExpertPlacement(max(experts, 1), tp,
                                                bool(getattr(config, "enable_expert_parallel", False)))
        self.model = HybridModel(config, lambda i: self.make_mlp(config, i, tp), tp=tp)
        self.head_dim = head_dim_of(config)
        self.kv_heads = tp.local_kv_heads(config.num_key_value_heads)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=self.head_dim, tp=tp)
        self.bind_cache(16, torch.float32)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        """Layer `layer`'s feed-forward: Qwen2-MoE's experts with the gated shared expert where
        HF puts experts, else a SwiGLU MLP."""
        if not is_sparse_layer(config, layer):
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)
        return self.make_moe(config, MoERouting.from_config(config), tp)

    def make_moe(self, config: Any, routing: MoERouting, tp: TPContext) -> nn.Module:
        """The sparse block: routed experts, the shared expert and its sigmoid gate."""
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, int(config.num_experts), routing,
                        act=config.hidden_act,
                        shared_intermediate_size=int(config.shared_expert_intermediate_size or 0),
                        shared_act=config.hidden_act, shared_gate=True, tp=tp,
                        expert_parallel=self.expert_placement.expert_parallel)

    def backbone(self) -> nn.Module:
        return self.model

    def bind_cache(self, block_size: int, cache_dtype: torch.dtype) -> None:
        """Fit every linear layer's state to the cache's blocks, then map the layers onto the
        cache entries and declare them (`kv_cache_spec`)."""
        for layer in self.model.layers:
            if layer.kind == LINEAR:
                layer.linear_attn.bind(block_size, cache_dtype)
        self.model.map_entries()
        specs = self.model.cache_specs(self.kv_heads, self.head_dim)
        self.kv_cache_spec = KVCacheSpec(len(specs), self.kv_heads, self.head_dim, specs)

    def load_weights(self, weights) -> None:
        """HF checkpoint tensors; fused DeltaNet projections are split first."""
        c = self.text_config
        super().load_weights(split_fused_projections(
            weights, num_k_heads=c.linear_num_key_heads, num_v_heads=c.linear_num_value_heads,
            head_k_dim=c.linear_key_head_dim, head_v_dim=c.linear_value_head_dim))

    def _rename(self, name: str) -> str | tuple | None:
        if name.startswith("mtp."):  # the multi-token-prediction head: not served
            return None
        name = super()._rename(name)
        return None if name is None else expert_param_name(name, self.expert_placement)
