"""Gemma 3 text decoder (`Gemma3ForCausalLM`, and the text part of `Gemma3ForConditionalGeneration`).

Differences from Llama, all as in HF 5.x:
- embeddings are multiplied by sqrt(hidden_size) cast to the model dtype;
- Gemma RMSNorm (`x * (1 + w)` in float32) everywhere, four per layer (input, post_attention,
  pre_feedforward, post_feedforward), plus per-head q/k norm before RoPE;
- attention scale `query_pre_attn_scalar ** -0.5`;
- `layer_types[i]` picks sliding-window ("sliding_attention", window `sliding_window`) or global
  attention, each with its own RoPE: `rope_parameters["sliding_attention"]` (local base, 1e4) and
  `rope_parameters["full_attention"]` (global base 1e6, possibly linear-scaled);
- gelu_pytorch_tanh gated MLP, tied LM head, optional `final_logit_softcapping`.
HF's Gemma3 attention never applies `attn_logit_softcapping` (it is not passed to the kernel), so
neither do we.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import VocabParallelEmbedding
from pagedserve.layers.norms import GemmaRMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.models.base import DecoderStack, KVCache, PagedCausalLM
from pagedserve.models.llama import FusableDecoderLayer, LlamaAttention, LlamaMLP
from pagedserve.models.multimodal_text import TextOfMultimodal

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma3_layer_types(config: Any) -> list[str]:
    """`config.layer_types`, or (older configs) every `sliding_window_pattern`-th layer global."""
    types = getattr(config, "layer_types", None)
    if types is None:
        pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"bad Gemma3 layer_types {types!r} for {config.num_hidden_layers} layers")
    return list(types)


def gemma3_rope_parameters(config: Any, layer_type: str) -> dict:
    """RoPE parameters of one layer type: the nested transformers 5 `rope_parameters`, or the
    transformers 4 attributes (`rope_theta` + `rope_scaling` global, `rope_local_base_freq` local)."""
    nested = getattr(config, "rope_parameters", None)
    if isinstance(nested, dict) and isinstance(nested.get(layer_type), dict):
        return rope_parameters(config, layer_type)
    if layer_type == SLIDING:
        return {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling["rope_type"] = scaling.get("rope_type") or scaling.get("type") or "default"
    scaling.setdefault("rope_theta", getattr(config, "rope_theta", None) or 1_000_000.0)
    return scaling


class Gemma3DecoderLayer(FusableDecoderLayer):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, config: Any, sliding_window: int | None, *, tp: TPContext = SINGLE,
                 qk_norm: bool = True, softcap: float | None = None):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            scale=config.query_pre_attn_scalar**-0.5,
            sliding_window=sliding_window,
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            qk_norm=(lambda d: GemmaRMSNorm(d, eps)) if qk_norm else None,
            tp=tp,
            softcap=softcap,
        )
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_activation, tp=tp)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def layer_norms(self) -> tuple:
        return (self.input_layernorm, self.post_attention_layernorm,
                self.pre_feedforward_layernorm, self.post_feedforward_layernorm)

    def unfused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3TextModel(DecoderStack):
    """Scaled embeddings, decoder layers with per-type RoPE, final norm (HF's `model.`)."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise NotImplementedError("Gemma3 with use_bidirectional_attention (embedding models) is unsupported")
        self.layer_types = gemma3_layer_types(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.embed_scale = nn.Buffer(torch.tensor(config.hidden_size**0.5, dtype=torch.float32), persistent=False)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, config.sliding_window if t == SLIDING else None, tp=tp)
            for t in self.layer_types
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        max_pos = config.max_position_embeddings
        self.rotary_emb = nn.ModuleDict(
            {
                t: RotaryEmbedding(config.head_dim, gemma3_rope_parameters(config, t), max_pos)
                for t in sorted(set(self.layer_types))
            }
        )

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        x = x * self.embed_scale.to(x.dtype)  # [T, H]; sqrt(hidden) rounded to the dtype, as HF
        ropes = {t: rope(positions, x.dtype) for t, rope in self.rotary_emb.items()}
        return x, [(ropes[t],) for t in self.layer_types]

    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.norm(x)


class Gemma3ForCausalLM(PagedCausalLM):
    """Gemma 3 text LM on a paged KV cache (see `pagedserve.models.base.CausalLM`); `tp` makes
    it this rank's shard."""

    apply_final_softcap = True

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.model = Gemma3TextModel(config, tp=tp)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, tp=tp)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def backbone(self) -> nn.Module:
        return self.model

    def final_softcap(self) -> float | None:
        return self.final_logit_softcapping if self.apply_final_softcap else None


class Gemma3ForConditionalGeneration(TextOfMultimodal, Gemma3ForCausalLM):
    """The text decoder of a multimodal Gemma 3 checkpoint (vision tower and projector weights are
    skipped; text-only inputs). Like HF's class, it applies no final logit softcapping."""

    apply_final_softcap = False
