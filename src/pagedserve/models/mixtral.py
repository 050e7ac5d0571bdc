"""Mixtral: the Llama / Mistral decoder with a mixture-of-experts feed-forward in every layer
(`layers.moe.FusedMoE`: softmax router, top-k renormalized, SwiGLU experts `w1` / `w3` / `w2`).

Also the pieces the other Llama-like MoE families reuse (Qwen2-MoE, Qwen3-MoE):
`MoEDecoderLayer` (Llama attention + any feed-forward module as `mlp`), `MoEModel` (embeddings,
those layers, final norm) and `MoECausalLM` (expert placement and the checkpoint's expert names).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import VocabParallelEmbedding
from pagedserve.layers.moe import ExpertPlacement, FusedMoE, MoERouting, expert_param_name
from pagedserve.layers.norms import RMSNorm
from pagedserve.models.base import KVCache, PagedCausalLM
from pagedserve.models.llama import LlamaAttention, LlamaModel, head_dim_of
from pagedserve.platforms import OpsUser


class MoEDecoderLayer(OpsUser, nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)), where `mlp` is a `FusedMoE` (or
    a dense MLP in the layers a config keeps dense). `attention` builds the attention module
    (default: `LlamaAttention` from the config).

    With Llama's attention, a decode step's attention half may run as one call of the platform
    (`self.ops.decoder_attention`: on CPU the fused decode kernel's attention half, bit-identical
    to the modules), then `mlp` from Python (on CPU its experts in one call)."""

    def __init__(self, config: Any, sliding_window: int | None, mlp: nn.Module, *,
                 qkv_bias: bool, qk_norm: bool, attention: nn.Module | None = None,
                 tp: TPContext = SINGLE):
        super().__init__()
        head_dim = head_dim_of(config)
        eps = config.rms_norm_eps
        self.self_attn = attention if attention is not None else LlamaAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            scale=head_dim**-0.5,
            sliding_window=sliding_window,
            qkv_bias=qkv_bias,
            o_bias=getattr(config, "attention_bias", False),
            qk_norm=(lambda d: RMSNorm(d, eps)) if qk_norm else None,
            tp=tp,
        )
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        # NOTE: exactly Llama's attention, or a module that declares the fused half computes it
        # (`fused_attention_half`: OLMoE's); another subclass may compute what the half does not
        self.fusable_attention = (type(self.self_attn) is LlamaAttention
                                  or getattr(type(self.self_attn), "fused_attention_half", False))

    def layer_norms(self) -> tuple:
        """(input, post-attention, pre-feedforward, post-feedforward) norms, as
        `models.llama.FusableDecoderLayer` names them (for the fused attention half)."""
        return (self.input_layernorm, self.post_attention_layernorm, None, None)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        if self.fusable_attention:
            fused = self.ops.decoder_attention(self, x, rope, kv_cache, meta)
            if fused is not None:
                r, h = fused  # [T, H] x + attention, its post-attention norm
                return r + self.mlp(h)
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoEModel(LlamaModel):
    """Embeddings, `MoEDecoderLayer`s (`layer_class`) and final norm (HF's `model.` submodule);
    `make_mlp(i)` builds layer i's feed-forward, `make_attention(i)` its attention (None:
    Llama's)."""

    layer_class: type = MoEDecoderLayer

    def __init__(self, config: Any, windows: list[int | None], make_mlp: Callable[[int], nn.Module], *,
                 qkv_bias: bool, qk_norm: bool,
                 make_attention: Callable[[int], nn.Module] | None = None, tp: TPContext = SINGLE):
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            self.layer_class(config, w, make_mlp(i), qkv_bias=qkv_bias, qk_norm=qk_norm,
                             attention=make_attention(i) if make_attention else None, tp=tp)
            for i, w in enumerate(windows)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = self.make_rotary_emb(config)  # (LlamaModel's: a family may override it)


class MoECausalLM(PagedCausalLM):
    """What the MoE families share: an LM over an `MoEModel`, where the experts sit
    (`expert_placement`, from the engine's `enable_expert_parallel`: the config attribute
    `enable_expert_parallel` the loader sets) and the checkpoint's per-expert names mapped onto
    the stacked experts (`layers.moe.expert_param_name`)."""

    tied_by_default = False
    qkv_bias = False
    qk_norm = False
    model_class: type = MoEModel  # a family's subclass of MoEModel
    # checkpoint names of the MoE block -> ours ("block_sparse_moe." -> "mlp." for Mixtral)
    moe_aliases: dict[str, str] = {}

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.expert_placement = ExpertPlacement(self.num_experts(config), tp,
                                                bool(getattr(config, "enable_expert_parallel", False)))
        self.model = self.model_class(config, self.sliding_windows(config), lambda i: self.make_mlp(config, i, tp),
                              qkv_bias=self.uses_qkv_bias(config),
                              qk_norm=self.qk_norm, make_attention=self.make_attention(config, tp), tp=tp)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=head_dim_of(config), tp=tp)

    def backbone(self) -> nn.Module:
        return self.model

    @staticmethod
    def num_experts(config: Any) -> int:
        return int(config.num_experts)

    def uses_qkv_bias(self, config: Any) -> bool:
        """Whether q/k/v have biases (Llama's `attention_bias`)."""
        return self.qkv_bias or bool(getattr(config, "attention_bias", False))

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        from pagedserve.models.llama import layer_sliding_windows

        return layer_sliding_windows(config)

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module] | None:
        """Layer i's attention module, or None for Llama's."""
        return None

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        """Layer `layer`'s feed-forward module."""
        raise NotImplementedError

    def _rename(self, name: str) -> str | tuple | None:
        name = super()._rename(name)
        if name is None:
            return None
        for old, new in self.moe_aliases.items():
            name = name.replace(old, new)
        return expert_param_name(name, self.expert_placement)


class MixtralForCausalLM(MoECausalLM):
    """Mixtral decoder-only LM: Mistral attention (`config.sliding_window` on every layer when
    set) and a `FusedMoE` in every layer (softmax, top-k renormalized, `num_local_experts`)."""

    moe_aliases = {".block_sparse_moe.": ".mlp."}

    @staticmethod
    def num_experts(config: Any) -> int:
        return int(config.num_local_experts)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers

    def routing(self, config: Any) -> MoERouting:
        """The router's rules (Mixtral's: softmax, top-k renormalized; Phi-3.5-MoE: sparsemixer)."""
        return MoERouting.from_config(config, renormalize=True)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        return FusedMoE(config.hidden_size, config.intermediate_size, self.num_experts(config),
                        self.routing(config), act=config.hidden_act,
                        tp=tp, expert_parallel=self.expert_placement.expert_parallel)
