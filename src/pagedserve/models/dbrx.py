"""DBRX (`DbrxForCausalLM`, Databricks): LayerNorm blocks with fused, clipped q/k/v and a softmax
mixture of experts in every layer.

As in HF 5.x (`DbrxModel`, names under `transformer.`):
- pre-norm blocks of torch's LayerNorm without bias (`norm_1` before attention, `norm_2` before
  the experts; the final `norm_f` likewise);
- attention: one fused `Wqkv` ([q; k; v] rows; split here into Llama's q / k / v), clamped to
  `[-clip_qkv, clip_qkv]` when `attn_config.clip_qkv` is set, whole-head RoPE (rotate-half),
  `kv_n_heads` KV heads, no biases;
- experts: the router (`ffn.router.layer`) softmax over all experts, the top `moe_top_k` chosen,
  their scores divided by their p-norm (`moe_normalize_expert_weights`: 1, the sum, is what is
  supported; None keeps them as they are); the experts stored as three `[E * I, H]` tensors
  `w1` (gate), `v1` (up) and `w2` (down, transposed), stacked here as `[E, I, H]` / `[E, H, I]`.
llama.cpp writes it as architecture "dbrx" (`models.gguf_arch_config`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import VocabParallelEmbedding
from pagedserve.layers.moe import FusedMoE, MoERouting
from pagedserve.layers.rotary import norm_and_rotate
from pagedserve.layers.weights import read_full, split_fused_weights
from pagedserve.models.base import KVCache
from pagedserve.models.llama import LlamaAttention, head_dim_of
from pagedserve.models.mixtral import MoECausalLM, MoEModel

# checkpoint names -> ours (the fused Wqkv split below; the experts' tensors restacked)
_RENAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
            ("transformer.blocks.", "model.layers."), (".norm_attn_norm.norm_1.", ".input_layernorm."),
            (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
            (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
            (".norm_attn_norm.attn.Wqkv.", ".self_attn.Wqkv."), (".ffn.router.layer.", ".mlp.gate."))
_EXPERTS = {".ffn.experts.mlp.w1": "gate_proj", ".ffn.experts.mlp.v1": "up_proj", ".ffn.experts.mlp.w2": "down_proj"}


def _layer_norm(hidden: int) -> nn.Module:
    return nn.LayerNorm(hidden, bias=False)  # (HF's: torch's, eps 1e-5)


class DbrxAttention(LlamaAttention):
    """Llama's attention (no biases) with q / k / v clamped to `clip_qkv` before RoPE."""

    def __init__(self, config: Any, tp: TPContext = SINGLE):
        head_dim = head_dim_of(config)
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                         scale=head_dim**-0.5, tp=tp)
        clip = config.attn_config.clip_qkv
        self.clip_qkv = None if clip is None else float(clip)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        q, k, v = self.qkv_heads(x)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k = norm_and_rotate(q.contiguous(), k.contiguous(), *rope, ops=self.ops)
        return self.o_proj(self.attn(q, k, v.contiguous(), kv_cache, meta))


class DbrxDecoderLayer(nn.Module):
    """Pre-norm block with LayerNorms: x + attn(norm_1(x)), then x + experts(norm_2(x))."""

    def __init__(self, config: Any, sliding_window: int | None, mlp: nn.Module, *, qkv_bias: bool,
                 qk_norm: bool, attention: nn.Module | None = None, tp: TPContext = SINGLE):
        super().__init__()
        self.self_attn = attention if attention is not None else DbrxAttention(config, tp)
        self.mlp = mlp
        self.input_layernorm = _layer_norm(config.hidden_size)
        self.post_attention_layernorm = _layer_norm(config.hidden_size)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DbrxModel(MoEModel):
    """Embeddings, DBRX layers and the final LayerNorm."""

    def __init__(self, config: Any, windows: list[int | None], make_mlp: Callable[[int], nn.Module], *,
                 qkv_bias: bool, qk_norm: bool, make_attention: Callable[[int], nn.Module] | None = None,
                 tp: TPContext = SINGLE):
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            DbrxDecoderLayer(config, w, make_mlp(i), qkv_bias=qkv_bias, qk_norm=qk_norm,
                             attention=make_attention(i) if make_attention else None, tp=tp)
            for i, w in enumerate(windows))
        self.norm = _layer_norm(config.hidden_size)
        self.rotary_emb = self.make_rotary_emb(config)


def dbrx_routing(config: Any) -> MoERouting:
    """Softmax over every expert, top `moe_top_k`, divided by their sum (p-norm 1) or not (None);
    ValueError for another `moe_normalize_expert_weights`."""
    ffn = config.ffn_config
    p = getattr(ffn, "moe_normalize_expert_weights", None)
    if p not in (None, 1, 1.0):
        raise ValueError(f"DBRX moe_normalize_expert_weights {p} is not supported (1 or None)")
    return MoERouting(top_k=int(ffn.moe_top_k), scoring="softmax", renormalize=p is not None)


class DbrxForCausalLM(MoECausalLM):
    """DBRX decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = DbrxModel

    def __init__(self, config: Any, **kwargs):
        super().__init__(config, **kwargs)
        head_dim = head_dim_of(config)  # (the fused Wqkv's rows: q, then k and v)
        self.qkv_rows = (config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim)

    @staticmethod
    def num_experts(config: Any) -> int:
        return int(config.ffn_config.moe_num_experts)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [None] * config.num_hidden_layers

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module]:
        return lambda i: DbrxAttention(config, tp)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        ffn = config.ffn_config
        act = (getattr(ffn, "ffn_act_fn", None) or {}).get("name", "silu")
        return FusedMoE(config.hidden_size, int(ffn.ffn_hidden_size), self.num_experts(config), dbrx_routing(config),
                        act=act, tp=tp, expert_parallel=self.expert_placement.expert_parallel)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        c = self.qkv_rows
        fused = {"self_attn.Wqkv": lambda: [("self_attn.q_proj", c[0]), ("self_attn.k_proj", c[1]),
                                             ("self_attn.v_proj", c[1])]}
        super().load_weights(split_fused_weights(self._dbrx_names(weights), fused))

    def _dbrx_names(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """DBRX's names as ours; its expert tensors `[E * I, H]` restacked as `[E, I, H]` (w2, the
        down projection stored transposed: `[E, H, I]`)."""
        e = self.expert_placement.num_experts
        for name, source in weights:
            for old, new in _RENAMES:
                name = name.replace(old, new)
            leaf = next((k for k in _EXPERTS if name.endswith(k)), None)
            if leaf is None:
                yield name, source
                continue
            t = read_full(source)
            t = t.view(e, -1, t.shape[-1])  # [E, I, H]
            if _EXPERTS[leaf] == "down_proj":
                t = t.transpose(1, 2)  # [E, H, I]
            yield name[: -len(leaf)] + ".mlp.experts." + _EXPERTS[leaf], t.contiguous()
