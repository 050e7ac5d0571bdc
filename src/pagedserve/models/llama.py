"""Llama-family decoder (Llama 2/3/3.1, Mistral) and the building blocks Qwen2/Qwen3/Gemma3 reuse.

Module and parameter names mirror HF's `LlamaForCausalLM`, so checkpoints load by name. Variants
are flags: `qkv_bias` (Qwen2), `qk_norm` (Qwen3, Gemma3), per-layer sliding windows (Mistral, Qwen2
with `use_sliding_window`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.kernels.cpu_decoder_layer import ACT_GELU_TANH, ACT_SILU, decoder_layer, weight_formats
from pagedserve.kernels.cpu_rotary import NORM_GEMMA, NORM_LLAMA
from pagedserve.layers.activation import get_activation
from pagedserve.layers.attention import PagedAttention
from pagedserve.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, norm_and_rotate, rope_parameters
from pagedserve.models.base import DecoderStack, KVCache, PagedCausalLM



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


class LlamaAttention(nn.Module):
    """Self-attention with separate q/k/v/o projections, optional per-head q/k norm before RoPE,
    grouped KV heads, paged KV cache.

    Under tensor parallelism each rank holds `num_heads / N` query heads and their KV heads
    (column-parallel q/k/v, row-parallel o); with fewer KV heads than ranks each rank holds the
    one KV head its query heads read (replicated). `num_heads` / `num_kv_heads` are this rank's.
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
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, scale, sliding_window)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, D]
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = norm_and_rotate(q, k, *rope, self.q_norm, self.k_norm)  # fused in place on CPU
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))  # [T, H]


_FUSED_ACTS = {
    "silu": ACT_SILU, "swish": ACT_SILU,
    "gelu_pytorch_tanh": ACT_GELU_TANH, "gelu_new": ACT_GELU_TANH, "gelu_fast": ACT_GELU_TANH,
    "gelu_python_tanh": ACT_GELU_TANH,
}


class LlamaMLP(nn.Module):
    """Gated MLP: `down(act(gate(x)) * up(x))` (gate/up column-parallel, down row-parallel)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False,
                 *, tp: TPContext = SINGLE):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, tp=tp)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp=tp)
        self.act_fn = get_activation(act)
        # the activation's code for the fused decode layer (None: not one it implements)
        self.fused_act = None if bias else _FUSED_ACTS.get(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FusableDecoderLayer(nn.Module):
    """A decoder layer of attention (`self_attn`) and a gated MLP (`mlp`) with RMS norms, which
    one-token decode steps may run through the fused CPU kernel (`fused_decode_layer`); the
    subclass names its norms and writes the unfused math."""

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
        fused = fused_decode_layer(self, x, rope, kv_cache, meta)
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
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class _FusedPlan:
    """What one layer passes to the fused decode call, gathered once (about 40 module attribute
    lookups a layer otherwise, every step). `usable` is False for layers the kernel cannot run."""

    usable: bool
    weights: list  # q, k, v, o, gate, up, down Parameters
    formats: list | None  # their kernel format codes (kernels.cpu_decoder_layer.weight_formats)
    biases: list  # q, k, v, o Parameters or None
    norms: tuple  # input, post-attn, pre-ff, post-ff, q, k norm modules or None
    norm_weights: list  # the present norms' weight Parameters
    mode: int  # the norms' numerics the layer needs: NORM_GEMMA (sandwich norms) or NORM_LLAMA
    consts: tuple  # num_heads, num_kv_heads, head_dim, scale, sliding_window, activation code
    # (the norm weights' (data_ptr, version) when built, ([fp32 weight or None] x 6, eps) or None)
    norm_cache: tuple | None = None


def _fused_plan(layer: FusableDecoderLayer) -> _FusedPlan:
    # NOTE: holds the Parameter objects themselves: loading weights copies into them in place and
    # `.to()` swaps their data, so the plan stays valid; a Parameter *replaced* by assignment
    # would not be seen (nothing in pagedserve does that to a decoder layer).
    plan = layer.__dict__.get("_fused_plan")
    if plan is None:
        attn, mlp, norms = layer.self_attn, layer.mlp, layer.layer_norms()
        all_norms = (*norms, attn.q_norm, attn.k_norm)
        weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
                   mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
        formats = weight_formats(weights)
        usable = not (formats is None or mlp.fused_act is None or attn.o_proj.tp.is_parallel
                      or mlp.down_proj.tp.is_parallel)
        plan = _FusedPlan(
            usable, weights, formats,
            [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, attn.o_proj.bias],
            all_norms,
            [m.weight for m in all_norms if m is not None],
            NORM_GEMMA if norms[2] is not None else NORM_LLAMA,
            (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scale,
             attn.attn.sliding_window, mlp.fused_act),
        )
        layer.__dict__["_fused_plan"] = plan
    return plan


def _norm_args(plan: _FusedPlan) -> tuple[list, float] | None:
    """The norms' fp32 weights (None where absent) and eps for the fused call, rebuilt only when
    a norm weight changes; None when a norm is one the kernels do not take, or eps / numerics are
    mixed."""
    key = tuple((w.data_ptr(), w._version) for w in plan.norm_weights)
    if plan.norm_cache is None or plan.norm_cache[0] != key:
        args = [None if m is None else m.kernel_args(torch.bfloat16) for m in plan.norms]
        present = [a for a, m in zip(args, plan.norms) if m is not None]
        ok = all(a is not None for a in present) and len({a[1:] for a in present}) == 1
        ok = ok and present[0][2] == plan.mode
        value = ([None if a is None else a[0] for a in args], present[0][1]) if ok else None
        plan.norm_cache = (key, value)
    return plan.norm_cache[1]


def fused_decode_layer(
    layer: FusableDecoderLayer,
    x: torch.Tensor,  # [T, H]
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_cache: KVCache,
    meta: AttentionMetadata,
) -> torch.Tensor | None:  # [T, H]
    """`layer` in one compiled call (`kernels.cpu_decoder_layer`, bit-identical to its modules)
    on a decode-only bf16 CPU step of the torch backend on one rank; None elsewhere.

    NOTE: the fused call bypasses the submodules' forward hooks (the profiler's attention hook
    among them): decode attention then counts as "forward (rest)".
    """
    if not (x.dtype is torch.bfloat16 and x.is_cpu and meta.backend == "torch"
            and len(meta.groups) == 1 and meta.groups[0].covers_all):
        return None
    lora = layer.__dict__.get("lora_stacks")  # lora.layers.LoRAStacks (engine's enable_lora)
    if lora is not None and lora.mapping is not None:
        return None  # a step with adapters: the unfused modules, whose hooks add the products
    plan = _fused_plan(layer)
    if not plan.usable:
        return None
    norm_args = _norm_args(plan)
    if norm_args is None:
        return None
    group = meta.groups[0]
    return decoder_layer(
        x, plan.weights, plan.formats, plan.biases, norm_args[0], plan.mode, norm_args[1],
        *rope, *kv_cache, meta.slot_mapping, group.block_tables, group.seq_lens, *plan.consts,
    )


class LlamaModel(DecoderStack):
    """Embeddings, decoder layers and final norm (HF's `model.` submodule)."""

    def __init__(self, config: Any, windows: list[int | None], *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, w, qkv_bias=qkv_bias, qk_norm=qk_norm, tp=tp) for w in windows
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        max_pos = config.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_parameters(config), max_pos)

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

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.model = LlamaModel(
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
