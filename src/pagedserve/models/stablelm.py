"""StableLM (`StableLmForCausalLM`: StableLM-3B-4E1T, StableLM 2 1.6B / 12B, StableCode).

Differences from Llama, as in HF 5.x:
- LayerNorms (weight and bias, `layer_norm_eps`) before attention and MLP, and at the end;
- `use_parallel_residual`: one norm feeds attention and MLP, `x + attn(ln(x)) + mlp(ln(x))`
  (StableLM 2 12B), else the sequential pre-norm block (`layers.residual`);
- partial RoPE (`partial_rotary_factor`, 0.25 by default), rotate-half;
- `use_qkv_bias` on q / k / v (none on o, none in the gated SiLU MLP);
- `qk_layernorm`: each head's q and k through its own LayerNorm (a weight, no bias: HF's
  `StableLmLayerNormPerHead`, one `norms.{i}` per head), stacked at load into one
  `[heads, head_dim]` weight (`models.cohere.CohereLayerNorm`: the same numerics) as llama.cpp's
  converter stacks them.
From GGUF: llama.cpp's "stablelm" (`models.gguf_classic`).
NOTE: LayerNorm layers are not `FusableDecoderLayer`s: they run their modules (decode too).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.norms import LayerNorm
from pagedserve.layers.residual import ResidualBlock
from pagedserve.layers.rotary import norm_and_rotate
from pagedserve.models.base import KVCache
from pagedserve.models.cohere import CohereLayerNorm, head_rows_shard
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, head_dim_of

_PER_HEAD_NORM = re.compile(r"(.*\.self_attn\.)([qk])_layernorm\.norms\.(\d+)\.weight$")


class StableLmAttention(LlamaAttention):
    """Llama's attention (grouped KV heads, paged cache, partial RoPE) with StableLM's optional
    per-head q / k LayerNorms (`[heads, head_dim]` weights: this rank's heads' rows)."""

    def __init__(self, config: Any, sliding_window: int | None, *, tp: TPContext = SINGLE):
        head_dim = head_dim_of(config)
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                         scale=head_dim**-0.5, sliding_window=sliding_window,
                         qkv_bias=bool(getattr(config, "use_qkv_bias", False)), o_bias=False, tp=tp)
        if getattr(config, "qk_layernorm", False):
            eps, heads, kv_heads = config.layer_norm_eps, config.num_attention_heads, config.num_key_value_heads
            self.q_norm = CohereLayerNorm(
                (self.num_heads, head_dim), eps,
                shard=head_rows_shard(tp, self.num_heads, (tp.rank, tp.world_size), heads))
            self.k_norm = CohereLayerNorm(
                (self.num_kv_heads, head_dim), eps,
                shard=head_rows_shard(tp, self.num_kv_heads, tp.kv_head_part(kv_heads), kv_heads))

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, R]
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        q, k, v = self.qkv_heads(x)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = norm_and_rotate(q, k, *rope, None, None, self.ops)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))  # [T, H]


class StableLmDecoderLayer(ResidualBlock):
    """StableLM's block: sequential pre-LayerNorms, or the parallel block on one LayerNorm
    (`use_parallel_residual`). Built as `LlamaModel` builds its layers."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        parallel = bool(getattr(config, "use_parallel_residual", False))
        eps = config.layer_norm_eps
        super().__init__(StableLmAttention(config, sliding_window, tp=tp),
                         LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp),
                         LayerNorm(config.hidden_size, eps=eps),
                         None if parallel else LayerNorm(config.hidden_size, eps=eps), parallel=parallel)


class StableLmModel(LlamaModel):
    """Llama's stack with StableLM's layers and a final LayerNorm."""

    layer_class = StableLmDecoderLayer

    def make_norm(self, config: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


def stack_head_norms(weights: Iterable[tuple[str, Any]], heads: int, kv_heads: int):
    """`weights` with each layer's per-head q / k norm weights (`...q_layernorm.norms.{i}.weight`,
    `[D]` each) stacked into one `...q_norm.weight` `[heads, D]`, yielded once all are seen."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, source in weights:
        m = _PER_HEAD_NORM.match(name)
        if m is None:
            yield name, source
            continue
        key = f"{m.group(1)}{m.group(2)}_norm.weight"
        rows = pending.setdefault(key, {})
        rows[int(m.group(3))] = source if isinstance(source, torch.Tensor) else source[:]
        if len(rows) == (heads if m.group(2) == "q" else kv_heads):
            yield key, torch.stack([rows[i] for i in range(len(rows))])
            del pending[key]
    if pending:
        raise ValueError(f"per-head q/k norm weights missing heads: {sorted(pending)}")


class StableLmForCausalLM(LlamaForCausalLM):
    """StableLM decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = StableLmModel

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        c = self.config
        super().load_weights(stack_head_norms(weights, c.num_attention_heads, c.num_key_value_heads))
