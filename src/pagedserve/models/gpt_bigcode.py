"""GPT-BigCode (`GPTBigCodeForCausalLM`: StarCoder 1, SantaCoder, WizardCoder), as HF 5.x
implements it: GPT-2's block (`models.gpt2`) with multi-query attention.

Differences from GPT-2:
- `nn.Linear` projections (`[out, in]`, not Conv1D: nothing transposed on load), all biased;
- `multi_query` (StarCoder's): `c_attn` is `[H + 2 D, H]`, q (every head), then one key head,
  then one value head; without it `c_attn` is `[3 H, H]` in per-head blocks `(q_h, k_h, v_h)`;
- no `scale_attn_by_inverse_layer_idx`; `attention_softmax_in_fp32` /
  `scale_attention_softmax_in_fp32` only change half-precision rounding (the softmax is float32
  here anyway);
- the LM head tied to `wte` (HF's default).
Under tensor parallelism a multi-query model's one KV head is not split: ValueError.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.attention import PagedAttention
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from pagedserve.layers.norms import LayerNorm
from pagedserve.models.base import DecoderStack, KVCache, PagedCausalLM
from pagedserve.models.gpt2 import GPT2Block, GPT2LMHeadModel, GPT2MLP, GPT2Model


class GPTBigCodeAttention(nn.Module):
    """Multi-query (one KV head) or multi-head attention with a fused, biased `c_attn`."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        h, heads = config.hidden_size, config.num_attention_heads
        if h % heads:
            raise ValueError(f"hidden_size ({h}) must be divisible by num_attention_heads ({heads})")
        self.head_dim = d = h // heads
        self.multi_query = bool(getattr(config, "multi_query", True))
        if self.multi_query and tp.is_parallel:
            raise ValueError("GPT-BigCode multi_query=True under tensor parallelism is not supported")
        self.num_heads = tp.split(heads, "num_attention_heads")
        self.num_kv_heads = 1 if self.multi_query else self.num_heads
        scale = d**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        self.c_attn = ColumnParallelLinear(h, h + 2 * d if self.multi_query else 3 * h, tp=tp)
        self.c_proj = RowParallelLinear(h, h, tp=tp)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, d, scale)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:  # [T, H]
        t, d = x.shape[0], self.head_dim
        qkv = self.c_attn(x)  # [T, H + 2D] or [T, 3H (this rank's)]
        if self.multi_query:
            q, k, v = qkv.split((self.num_heads * d, d, d), dim=-1)
            q, k, v = q.view(t, self.num_heads, d), k.view(t, 1, d), v.view(t, 1, d)
        else:  # per-head (q, k, v) blocks
            q, k, v = qkv.view(t, self.num_heads, 3 * d).split(d, dim=-1)  # 3 x [T, Hq, D]
        return self.c_proj(self.attn(q.contiguous(), k.contiguous(), v.contiguous(), kv_cache, meta))  # [T, H]


class GPTBigCodeBlock(GPT2Block):
    """GPT-2's pre-norm block with GPT-BigCode's attention."""

    def __init__(self, config: Any, layer_idx: int, *, tp: TPContext = SINGLE):
        nn.Module.__init__(self)  # (GPT-2's modules built here, not GPT2Block's)
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-BigCode with cross-attention is not a causal LM; not supported")
        self.ln_1 = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = GPTBigCodeAttention(config, tp=tp)
        self.ln_2 = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = GPT2MLP(config, tp=tp)


class GPTBigCodeModel(GPT2Model):
    """GPT-2's stack (token + learned position embeddings, final LayerNorm) of GPT-BigCode blocks."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        DecoderStack.__init__(self)
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPTBigCodeBlock(config, i, tp=tp) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    """GPT-BigCode LM on a paged KV cache (see the module docstring)."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        PagedCausalLM.__init__(self)
        self.transformer = GPTBigCodeModel(config, tp=tp)
        kv = 1 if getattr(config, "multi_query", True) else config.num_attention_heads
        self._init_head(config, self.transformer.wte, head_in=config.hidden_size, num_kv_heads=kv,
                        head_dim=config.hidden_size // config.num_attention_heads, tp=tp)

    def _transposed(self) -> Callable[[str], bool] | None:
        return None  # (nn.Linear weights, not Conv1D)
