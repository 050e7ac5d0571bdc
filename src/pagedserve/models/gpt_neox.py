"""GPT-NeoX (`GPTNeoXForCausalLM`: Pythia, GPT-NeoX-20B, RedPajama-INCITE, Dolly v2).

Differences from Llama, as in HF 5.x:
- one fused `attention.query_key_value` whose rows are per head `[q; k; v]` (`[heads, 3,
  head_dim]`), split at load into Llama's q / k / v projections (a tensor-parallel shard then
  reads its heads of each);
- LayerNorms (weight and bias) before attention (`input_layernorm`) and MLP
  (`post_attention_layernorm`) and at the end (`final_layer_norm`);
- `use_parallel_residual` (the default): `x + attn(ln1(x)) + mlp(ln2(x))`, else the sequential
  pre-norm block (`layers.residual`);
- partial RoPE (`partial_rotary_factor`, HF's `rotary_pct`: 0.25 for Pythia), rotate-half;
- `attention_bias` on q / k / v / o; a non-gated gelu MLP with biases (`dense_h_to_4h`,
  `dense_4h_to_h`); every head its own KV head; the LM head `embed_out` (older checkpoints) or
  `lm_head`, not tied by default.
The modules take Llama's names; the checkpoint's are renamed at load. From GGUF: llama.cpp's
"gptneox" (`models.gguf_classic`; its converter already regroups `attn_qkv` as `[q; k; v]`).
NOTE: LayerNorm layers are not `FusableDecoderLayer`s: they run their modules (decode too).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.mlp import PlainMLP
from pagedserve.layers.norms import LayerNorm
from pagedserve.layers.residual import ResidualBlock
from pagedserve.layers.weights import read_full, split_fused_weights
from pagedserve.models.base import RenamedCheckpoint
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaModel, head_dim_of

# HF's per-head interleaved q|k|v (the checkpoint's) and the [q; k; v] rows of a GGUF's attn_qkv
_HF_QKV, _GGUF_QKV = "self_attn.query_key_value", "self_attn.qkv_proj"


def gpt_neox_config(config: Any) -> Any:
    """A copy of `config` with `num_key_value_heads` (GPT-NeoX's: one per head, whatever a
    stray attribute says) for Llama's pieces, which read it."""
    if getattr(config, "num_key_value_heads", None) == config.num_attention_heads:
        return config
    config = copy.copy(config)
    config.num_key_value_heads = config.num_attention_heads
    return config


class GPTNeoXLayer(ResidualBlock):
    """GPT-NeoX's block: attention and MLP each on its own LayerNorm, in parallel or in turn."""

    def __init__(self, config: Any, sliding_window: int | None, *, qkv_bias: bool, qk_norm: bool,
                 tp: TPContext = SINGLE):
        head_dim, eps, bias = head_dim_of(config), config.layer_norm_eps, bool(config.attention_bias)
        heads = config.num_attention_heads
        attn = LlamaAttention(config.hidden_size, heads, heads, head_dim, scale=head_dim**-0.5,
                              sliding_window=sliding_window, qkv_bias=bias, o_bias=bias, tp=tp)
        mlp = PlainMLP(config.hidden_size, config.intermediate_size, config.hidden_act, True, tp=tp)
        super().__init__(attn, mlp, LayerNorm(config.hidden_size, eps=eps), LayerNorm(config.hidden_size, eps=eps),
                         parallel=bool(config.use_parallel_residual))


class GPTNeoXModel(LlamaModel):
    """Llama's stack with GPT-NeoX's layers and a final LayerNorm."""

    layer_class = GPTNeoXLayer

    def make_norm(self, config: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


def _split_interleaved_qkv(weights: Iterable[tuple[str, Any]], heads: int):
    """`weights` with each HF `...query_key_value.{weight,bias}` (`[heads * 3 * D, ...]`, per
    head q, k, v) yielded as `...q_proj` / `k_proj` / `v_proj` (`[heads * D, ...]` each)."""
    for name, source in weights:
        stem, _, suffix = name.rpartition(".")
        if not stem.endswith(_HF_QKV):
            yield name, source
            continue
        w = read_full(source)  # [H * 3 * D, ...]
        parts = w.reshape(heads, 3, -1, *w.shape[1:])  # [H, 3, D, ...]
        prefix = stem[: -len("query_key_value")]
        for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
            yield f"{prefix}{part}.{suffix}", parts[:, i].reshape(-1, *w.shape[1:]).contiguous()


class GPTNeoXForCausalLM(RenamedCheckpoint, LlamaForCausalLM):
    """GPT-NeoX decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = GPTNeoXModel
    checkpoint_renames = (
        ("gpt_neox.", "model."),
        ("model.embed_in.", "model.embed_tokens."),
        ("model.final_layer_norm.", "model.norm."),
        (".attention.dense.", ".self_attn.o_proj."),
        (".mlp.dense_h_to_4h.", ".mlp.up_proj."),
        (".mlp.dense_4h_to_h.", ".mlp.down_proj."),
        ("embed_out.", "lm_head."),
    )

    def __init__(self, config: Any, **kwargs):
        super().__init__(gpt_neox_config(config), **kwargs)

    def _rename(self, name: str) -> str | tuple | None:
        if name.endswith((".attention.bias", ".attention.masked_bias")):  # older files' mask buffers
            return None
        return super()._rename(name)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """As the base class's, HF's per-head `query_key_value` regrouped into q / k / v (and a
        GGUF's `[q; k; v]` `attn_qkv`, `self_attn.qkv_proj`, split by rows)."""
        c = self.config
        hidden = c.num_attention_heads * head_dim_of(c)
        renamed = ((n.replace(".attention.query_key_value.", f".{_HF_QKV}."), s) for n, s in weights)
        parts = lambda: [("self_attn.q_proj", hidden), ("self_attn.k_proj", hidden), ("self_attn.v_proj", hidden)]  # noqa: E731
        super().load_weights(split_fused_weights(_split_interleaved_qkv(renamed, c.num_attention_heads),
                                                 {_GGUF_QKV: parts}))
