"""Llama 4 (`Llama4ForCausalLM`, model_type "llama4_text"; the text decoder of
`Llama4ForConditionalGeneration`, model_type "llama4": Llama 4 Scout / Maverick), text-only.

As HF 5.x's `Llama4TextModel`, per layer i:
- attention with q/k/v/o (biases with `attention_bias`), grouped KV heads, scale head_dim^-0.5;
- RoPE layers (`no_rope_layers[i]` = 1; by default all but every `no_rope_layer_interval`-th):
  RoPE on *interleaved pairs* (HF's complex product over consecutive pairs, in float32), any HF
  rope scaling (Llama 3's for the released models), then with `use_qk_norm` a weightless RMS
  norm of each q and k head ("L2 norm", eps `rms_norm_eps`) *after* RoPE;
- NoPE layers: no position embedding and no q/k norm; with `attn_temperature_tuning` each query
  is multiplied (in float32, cast back) by `log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`
  for its position p -- exactly 1 while p + 1 < floor_scale, where a decode step may take the
  fused attention half (the identity rotation, as SmolLM3's NoPE layers);
- the feed-forward of the `moe_layers` (by default every `interleave_moe_layer_step`-th) is a
  mixture of experts (`layers.moe.FusedMoE`): the router's top-k *logits* pick the experts, the
  sigmoid of each weighs the expert's *input* (`expert(x * w)`; `MoERouting.weight_on_input`,
  one expert per token as every released model), plus a shared expert (a plain gated MLP of
  `intermediate_size`); the other layers have a dense gated MLP of `intermediate_size_mlp`.

Checkpoints store the experts fused: `feed_forward.experts.gate_up_proj` `[E, H, 2I]` (gate the
first I columns, up the last I) and `feed_forward.experts.down_proj` `[E, I, H]`; `load_weights`
splits and transposes them onto the MoE layer's `gate_proj` / `up_proj` `[E, I, H]` and
`down_proj` `[E, H, I]` (`models.fused_experts`; then sharded or split by expert as any
family's stacked experts).

Chunked attention (limitation): the layers `layer_types` marks "chunked_attention" (HF's default:
the RoPE layers) attend only within aligned chunks of `attention_chunk_size` (8192) positions.
Our attention kernels have no such mask; for positions below `attention_chunk_size` it is plain
causal attention, so we serve exactly that: a `max_model_len` past `attention_chunk_size` is a
ValueError naming both (`Llama4ForCausalLM.context_limit`, which the engine asks before loading;
`load_model(max_model_len=...)` and a step reaching such a position refuse it too), and without
an explicit `max_model_len` the engine serves `attention_chunk_size` tokens.

llama.cpp writes these models as architecture "llama4" (`models.gguf_config`: the NoPE layout,
chunk and temperature it fixes rather than stores).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import TPContext
from pagedserve.layers.linear import linear_outputs
from pagedserve.layers.moe import FusedMoE, MoERouting
from pagedserve.layers.norms import WeightlessRMSNorm
from pagedserve.layers.rotary import apply_rotary
from pagedserve.models.base import KVCache
from pagedserve.models.fused_experts import split_fused_experts
from pagedserve.models.llama import LlamaAttention, LlamaMLP, head_dim_of
from pagedserve.models.mixtral import MixtralForCausalLM, MoEDecoderLayer, MoEModel
from pagedserve.models.multimodal_text import TextOfMultimodal
from pagedserve.models.smollm3 import smollm3_rope_layers

CHUNKED, FULL = "chunked_attention", "full_attention"


def chunked_attention_size(config: Any) -> int | None:
    """`attention_chunk_size` when some layer of the text `config` is a chunked-attention one
    (`layer_types`), else None. ValueError for a layer type we do not know, or chunked layers
    without a chunk size."""
    types = list(getattr(config, "layer_types", None) or [])
    unknown = sorted(set(types) - {CHUNKED, FULL})
    if unknown:
        raise ValueError(f"Llama 4: unsupported layer_types {unknown}; supported: {CHUNKED}, {FULL}")
    if CHUNKED not in types:
        return None
    size = getattr(config, "attention_chunk_size", None)
    if not size:
        raise ValueError("Llama 4: layer_types has chunked_attention layers but attention_chunk_size "
                         f"is {size!r}")
    return int(size)


def check_max_model_len(max_model_len: int, chunk: int | None) -> None:
    """ValueError unless `max_model_len` lies within the chunk (see the module docstring).

    NOTE: chunked attention is computed as full causal attention, which it equals only while
    every position lies in the first chunk (positions < attention_chunk_size). Every way a
    longer context could be served must pass here: the engine's max_model_len (before loading),
    `load_model(max_model_len=...)` (`Llama4Model.set_max_model_len`) and each step's longest
    context (`Llama4DecoderLayer.forward`, from the metadata's host-side max_seq_len)."""
    if chunk is not None and max_model_len > chunk:
        raise ValueError(
            f"max_model_len ({max_model_len}) exceeds Llama 4's attention_chunk_size ({chunk}): its "
            "chunked-attention layers attend within chunks of that many tokens, which pagedserve "
            f"does not implement (exact up to {chunk} tokens); serve max_model_len <= {chunk}")


def moe_layers(config: Any) -> set[int]:
    """The layers with experts (`moe_layers`, else every `interleave_moe_layer_step`-th, as HF)."""
    layers = getattr(config, "moe_layers", None)
    if layers is None:
        step = int(getattr(config, "interleave_moe_layer_step", 1) or 1)
        layers = range(step - 1, config.num_hidden_layers, step)
    return {int(i) for i in layers}


def attention_temperature(positions: torch.Tensor, floor_scale: int,
                          attn_scale: float) -> torch.Tensor:  # [T] -> [T, 1, 1] fp32
    """Llama 4's per-position query scale of the NoPE layers, in HF's float32 arithmetic
    (exactly 1 while `p + 1 < floor_scale`)."""
    scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # [T]
    return scale[:, None, None]  # [T, 1, 1]


class Llama4Attention(LlamaAttention):
    """Llama 4's attention of one layer: RoPE on interleaved pairs in float32 and the weightless
    q/k norm after it (RoPE layers), or neither (NoPE layers, whose queries take the step's
    temperature `q_scale`)."""

    def __init__(self, config: Any, use_rope: bool, *, tp: TPContext):
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
                         head_dim, scale=head_dim**-0.5, qkv_bias=bias, o_bias=bias, tp=tp,
                         rope_interleaved=use_rope)
        self.use_rope = use_rope
        # HF norms q and k on the RoPE layers only
        self.l2_norm = (WeightlessRMSNorm(config.rms_norm_eps)
                        if use_rope and getattr(config, "use_qk_norm", True) else None)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, D] (fp32 on RoPE layers)
        kv_cache: KVCache,
        meta: AttentionMetadata,
        q_scale: torch.Tensor | None = None,  # [T, 1, 1] fp32 (NoPE layers)
    ) -> torch.Tensor:  # [T, H]
        t = x.shape[0]
        q, k, v = linear_outputs(x, self.fusable_linears()[0])
        q = q.view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.use_rope:  # HF's complex product in float32, cast back
            q32, k32 = apply_rotary(q.float(), k.float(), *rope, interleaved=True)
            q, k = q32.to(q.dtype), k32.to(k.dtype)
        if self.l2_norm is not None:  # NOTE: after RoPE (HF's order), unlike Qwen3's q/k norms
            q, k = self.l2_norm(q), self.l2_norm(k)
        if q_scale is not None:
            q = (q * q_scale).to(v.dtype)  # [T, Hq, D]
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))  # [T, H]


class Llama4DecoderLayer(MoEDecoderLayer):
    """Pre-norm block with Llama 4's attention and a dense MLP or the MoE block as `mlp`; called
    with the layer's RoPE tables and query scale (None: no temperature tuning)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # NOTE: a NoPE layer is Llama's attention with the identity rotation and no q/k norm,
        # which the fused attention half computes bit for bit (steps with q_scale None only);
        # a RoPE layer rotates pairs in float32 and norms after RoPE: its modules always.
        self.fusable_attention = not self.self_attn.use_rope

    # set by the stack: the attention chunk (None: no chunked layer) and the temperature's
    # floor_scale (a step whose context stays below it has every scale exactly 1)
    chunk_size: int | None = None
    floor_scale: int = 0

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],
        q_scale: torch.Tensor | None,  # [T, 1, 1] fp32, or None
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        # (the metadata's host-side max_seq_len: the step's longest context, no device read)
        check_max_model_len(meta.max_seq_len, self.chunk_size)
        if q_scale is None or 0 < meta.max_seq_len < self.floor_scale:
            return super().forward(x, rope, kv_cache, meta)
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, q_scale)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama4Model(MoEModel):
    """Embeddings, Llama 4 layers, final norm; `embed` hands each layer its RoPE tables (the
    identity on NoPE layers) and query scale."""

    layer_class = Llama4DecoderLayer
    rope_interleaved = True

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        self.use_rope = llama4_rope_layers(config)
        self.chunk_size = chunked_attention_size(config)
        self.temperature = ((int(config.floor_scale), float(config.attn_scale))
                            if getattr(config, "attn_temperature_tuning", True) else None)
        for layer in self.layers:
            layer.chunk_size = self.chunk_size
            layer.floor_scale = self.temperature[0] if self.temperature else 0

    def set_max_model_len(self, max_model_len: int) -> None:
        """ValueError past the attention chunk (`load_model(max_model_len=...)` calls it)."""
        check_max_model_len(max_model_len, self.chunk_size)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary_emb(positions, torch.float32)  # 2 x [T, D] fp32 (HF rotates in fp32)
        extras = []
        if not all(self.use_rope):
            identity = (torch.ones_like(rope[0], dtype=x.dtype),
                        torch.zeros_like(rope[1], dtype=x.dtype))  # [T, D]: NoPE
            scale = None if self.temperature is None else attention_temperature(positions, *self.temperature)
        for use_rope in self.use_rope:
            extras.append((rope, None) if use_rope else (identity, scale))
        return x, extras


def llama4_rope_layers(config: Any) -> list[bool]:
    """Whether each layer applies RoPE (`no_rope_layers[i]` = 1; HF derives every
    `no_rope_layer_interval`-th layer as NoPE when the list is missing or empty)."""
    if getattr(config, "no_rope_layers", None) == []:  # (SmolLM3's helper: None only)
        config = copy.copy(config)
        config.no_rope_layers = None
    return smollm3_rope_layers(config)


class Llama4ForCausalLM(MixtralForCausalLM):
    """Llama 4's text decoder on a paged KV cache (see the module docstring): Mixtral's expert
    count (`num_local_experts`) and windows (none: the config has no `sliding_window`)."""

    model_class = Llama4Model
    moe_aliases = {".feed_forward.": ".mlp.", ".mlp.router.": ".mlp.gate."}

    def __init__(self, config: Any, **kwargs: Any):
        k = int(getattr(config, "num_experts_per_tok", 1))
        if k != 1:
            raise ValueError(f"Llama 4: num_experts_per_tok {k} is not supported (the routing weight "
                             "scales the expert's input, implemented for one expert per token)")
        super().__init__(config, **kwargs)

    @staticmethod
    def context_limit(config: Any) -> int | None:
        """The longest context served exactly: `attention_chunk_size` where chunked-attention
        layers exist, else None (the engine's `max_model_len` check asks this)."""
        return chunked_attention_size(getattr(config, "text_config", None) or config)

    @staticmethod
    def check_max_model_len(config: Any, max_model_len: int) -> None:
        """ValueError naming max_model_len and attention_chunk_size past the chunk."""
        check_max_model_len(max_model_len, Llama4ForCausalLM.context_limit(config))

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module]:
        use_rope = llama4_rope_layers(config)
        return lambda i: Llama4Attention(config, use_rope[i], tp=tp)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        if layer not in moe_layers(config):
            return LlamaMLP(config.hidden_size, config.intermediate_size_mlp, config.hidden_act, tp=tp)
        routing = MoERouting(top_k=1, scoring="sigmoid_topk", weight_on_input=True)
        return FusedMoE(config.hidden_size, config.intermediate_size, self.num_experts(config), routing,
                        act=config.hidden_act, shared_intermediate_size=config.intermediate_size,
                        shared_act=config.hidden_act, tp=tp,
                        expert_parallel=self.expert_placement.expert_parallel)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF Llama 4 checkpoint tensors (or a GGUF file's mapped to HF names), the fused experts
        split onto the stacked layout (see the module docstring)."""
        super().load_weights(split_fused_experts(weights))


class Llama4ForConditionalGeneration(TextOfMultimodal, Llama4ForCausalLM):
    """The text decoder of a Llama 4 checkpoint (`language_model.`; the vision model and the
    projector are skipped; text-only inputs)."""

    _SKIP = TextOfMultimodal._SKIP + ("vision_model.", "model.vision_model.")
