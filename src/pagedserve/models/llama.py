"""Llama-family decoder (Llama 2/3/3.1, Mistral) and the building blocks Qwen2/Qwen3/Gemma3 reuse.

Module and parameter names mirror HF's `LlamaForCausalLM`, so checkpoints load by name. Variants
are flags: `qkv_bias` (Qwen2), `qk_norm` (Qwen3, Gemma3), per-layer sliding windows (Mistral, Qwen2
with `use_sliding_window`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import get_activation
from pagedserve.layers.attention import PagedAttention
from pagedserve.layers.linear import (
    ColumnParallelLinear,
    FusableLinears,
    RowParallelLinear,
    VocabParallelEmbedding,
    linear_outputs,
)
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, norm_and_rotate, rope_parameters
from pagedserve.models.base import DecoderStack, KVCache, PagedCausalLM
from pagedserve.platforms import OpsUser



def head_dim_of(config: Any) -> int:
    """`config.head_dim` when set, else hidden_size // num_attention_heads (as HF)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Sliding window of each layer (None = full attention), as HF derives it: from `layer_types`
    when the config has them, else (transformers 4 Qwen2/3) sliding for layers >= max_window_layers
    when `use_sliding_window` is set."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        if not getattr(config, "use_sliding_window", False):
            window = None
        start = getattr(config, "max_window_layers", 0)
        types = ["sliding_attention" if window is not None and i >= start else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ValueError(f"config.layer_types has {len(types)} entries for {n} layers")
    return [window if t == "sliding_attention" else None for t in types]


class LlamaAttention(OpsUser, FusableLinears, nn.Module):
    """Self-attention with separate q/k/v/o projections, optional per-head q/k norm before RoPE,
    grouped KV heads, paged KV cache.

    Under tensor parallelism each rank holds `num_heads / N` query heads and their KV heads
    (column-parallel q/k/v, row-parallel o); with fewer KV heads than ranks each rank holds the
    one KV head its query heads read (replicated). `num_heads` / `num_kv_heads` are this rank's.
    Options other families set: `softcap` (Gemma 2's attention logit soft-capping, an option of
    the attention call), `rope_interleaved` (GLM's pairwise RoPE layout, `layers.rotary`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        scale: float,
        sliding_window: int | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: Callable[[int], nn.Module] | None = None,
        tp: TPContext = SINGLE,
        softcap: float | None = None,
        rope_interleaved: bool = False,
    ):
        super().__init__()
        self.num_heads = tp.split(num_heads, "num_attention_heads")
        kv_part = tp.kv_head_part(num_kv_heads)
        self.num_kv_heads, self.head_dim = tp.local_kv_heads(num_kv_heads), head_dim
        self.q_proj = ColumnParallelLinear(hidden_size, num_heads * head_dim, qkv_bias, tp=tp)
        self.k_proj = ColumnParallelLinear(hidden_size, num_kv_heads * head_dim, qkv_bias, tp=tp,
                                           part=kv_part)
        self.v_proj = ColumnParallelLinear(hidden_size, num_kv_heads * head_dim, qkv_bias, tp=tp,
                                           part=kv_part)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, o_bias, tp=tp)
        self.q_norm = qk_norm(head_dim) if qk_norm else None
        self.k_norm = qk_norm(head_dim) if qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, scale, sliding_window,
                                   softcap=softcap)
        self.rope_interleaved = rope_interleaved

    def fusable_linears(self) -> tuple[tuple[nn.Module, ...], ...]:
        """The projections that read one input, which a platform may put in one buffer
        (`layers.linear.fuse_linears`): q, k and v."""
        return ((self.q_proj, self.k_proj, self.v_proj),)

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q / k / v projections of `x [T, H]` split into heads: `[T, Hq, D]`, `[T, Hkv, D]`,
        `[T, Hkv, D]` (one product where the platform fused them)."""
        t = x.shape[0]
        q, k, v = linear_outputs(x, self.fusable_linears()[0])
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, D]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        q_scale: torch.Tensor | None = None,  # [T, 1, 1] in q's dtype (`models.ministral3`)
    ) -> torch.Tensor:  # [T, H]
        q, k, v = self.qkv_heads(x)
        q, k = norm_and_rotate(q, k, *rope, self.q_norm, self.k_norm, self.ops,
                               self.rope_interleaved)  # fused in place on CPU
        if q_scale is not None:  # a per-token attention temperature, after RoPE (as HF)
            q = q * q_scale  # [T, Hq, D]
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))  # [T, H]


class LlamaMLP(OpsUser, FusableLinears, nn.Module):
    """Gated MLP: `down(act(gate(x)) * up(x))` (gate/up column-parallel, down row-parallel)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False,
                 *, tp: TPContext = SINGLE):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, tp=tp)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp=tp)
        self.act_fn = get_activation(act)
        self.act_name, self.mlp_bias = act, bias  # for a fused decode layer (`LayerOps`)

    def fusable_linears(self) -> tuple[tuple[nn.Module, ...], ...]:
        """The projections that read one input, which a platform may put in one buffer
        (`layers.linear.fuse_linears`): gate and up."""
        return ((self.gate_proj, self.up_proj),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate, up = linear_outputs(x, self.fusable_linears()[0])  # [T, I] each
        h = None
        if self.act_fn.kernel is not None and gate.dim() == 2:  # one kernel where the ops have it
            h = self.ops.gated_activation(gate, up, self.act_fn.kernel)
        return self.down_proj(self.act_fn(gate) * up if h is None else h)


class FusableDecoderLayer(OpsUser, nn.Module):
    """A decoder layer of attention (`self_attn`) and a gated MLP (`mlp`) with RMS norms, which
    the platform may run in one call (`self.ops.decoder_layer`: the CPU platform's fused decode
    kernel, `platforms.cpu_decode`, on one-token bf16 decode steps); the subclass names its norms
    and writes the unfused math."""

    def layer_norms(self) -> tuple:
        """(input, post-attention, pre-feedforward, post-feedforward) norms; None where absent."""
        raise NotImplementedError

    def unfused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        """The layer in torch ops (prompts, other dtypes, no kernel)."""
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        fused = self.ops.decoder_layer(self, x, rope, kv_cache, meta)
        return self.unfused(x, rope, kv_cache, meta) if fused is None else fused


class LlamaDecoderLayer(FusableDecoderLayer):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        super().__init__()
        head_dim = head_dim_of(config)
        eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(
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
        self.mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, getattr(config, "mlp_bias", False),
            tp=tp,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def layer_norms(self) -> tuple:
        return (self.input_layernorm, self.post_attention_layernorm, None, None)

    def unfused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H] -> [T, H]; `q_scale`: the attention's per-token query scale (LlamaAttention)."""
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, q_scale)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(DecoderStack):
    """Embeddings, decoder layers and final norm (HF's `model.` submodule). A Llama-like family
    sets `layer_class` (its decoder layer, built as `layer_class(config, window, qkv_bias=,
    qk_norm=, tp=)`) and `rope_interleaved` in a subclass."""

    layer_class: type = LlamaDecoderLayer
    rope_interleaved = False  # GLM: RoPE on interleaved pairs (layers.rotary)

    def __init__(self, config: Any, windows: list[int | None], *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            self.layer_class(config, w, qkv_bias=qkv_bias, qk_norm=qk_norm, tp=tp) for w in windows
        )
        self.norm = self.make_norm(config)
        self.rotary_emb = self.make_rotary_emb(config)

    def make_norm(self, config: Any) -> nn.Module:
        """The final norm (Llama's RMSNorm; Cohere's LayerNorm)."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_rotary_emb(self, config: Any) -> nn.Module:
        """The stack's RoPE: one `RotaryEmbedding` for every layer (a family with RoPE per layer
        type builds several and gives each layer its own in `embed`, as OLMo 3)."""
        return RotaryEmbedding(head_dim_of(config), rope_parameters(config), config.max_position_embeddings,
                               interleaved=self.rope_interleaved)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary_emb(positions, x.dtype)  # 2 x [T, D]
        return x, [(rope,)] * len(self.layers)

    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.norm(x)


class LlamaForCausalLM(PagedCausalLM):
    """Llama decoder-only LM on a paged KV cache (see `pagedserve.models.base.CausalLM`); `tp`
    makes it this rank's shard (its KV cache spec then counts this rank's KV heads)."""

    qkv_bias = False  # Qwen2: True (Llama reads config.attention_bias)
    qk_norm = False  # Qwen3: True
    tied_by_default = False
    model_class: type = LlamaModel  # a Llama-like family's subclass of LlamaModel

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.model = self.model_class(
            config,
            self.sliding_windows(config),
            qkv_bias=self.qkv_bias or getattr(config, "attention_bias", False),
            qk_norm=self.qk_norm,
            tp=tp,
        )
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=head_dim_of(config), tp=tp)

    def backbone(self) -> nn.Module:
        return self.model

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        """Per-layer sliding windows (None = full attention)."""
        return layer_sliding_windows(config)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with `config.sliding_window` (when set) on every layer, as HF's Mistral."""

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers


class MinistralForCausalLM(LlamaForCausalLM):
    """Ministral (8B, 2410): Llama with a sliding window on the layers `config.layer_types` names
    (HF's default: every layer when `sliding_window` is set)."""
