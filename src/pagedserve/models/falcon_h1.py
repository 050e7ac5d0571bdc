"""Falcon-H1 (`FalconH1ForCausalLM`, TII): every layer runs a Mamba2 mixer and attention side by
side on the same normed input, then a SwiGLU MLP, with muP multipliers throughout.

As HF 5.x, layer by layer: `h = norm(x)`;
`x += mamba(h) * ssm_out_multiplier + attention(h * attention_in_multiplier) *
attention_out_multiplier`; `x += mlp(norm(x))`, where
- the mixer (`layers.mamba2`) takes `h * ssm_in_multiplier`, scales its input projection's five
  parts (z, x, B, C, dt) by `ssm_multipliers` (HF's `mup_vector`), has `mamba_d_ssm` channels,
  `out_proj`'s bias from `projectors_bias`, and gates its output through the gated RMSNorm
  (`mamba_rms_norm`, `mamba_norm_before_gate`) or by `silu(z)` alone;
- attention multiplies its keys by `key_multiplier` (before RoPE);
- the MLP is `down(up(x) * silu(gate(x) * m0)) * m1` (`mlp_multipliers`);
- embeddings times `embedding_multiplier`, logits times `lm_head_multiplier`.
A layer's cache entries: its attention's one, then its mixer's state (`models.mamba_hybrid`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import get_activation
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.layers.mamba2 import Mamba2Mixer
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.recurrent_state import KVPair
from pagedserve.models.granite import LogitsScaling
from pagedserve.models.llama import LlamaAttention, head_dim_of
from pagedserve.models.mamba_hybrid import HybridCausalLM, HybridLayer, HybridModel, page_of

# HF's parameter names -> ours (a checkpoint name's segments)
_RENAMES = (
    (".feed_forward.", ".mlp."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    ("model.final_layernorm.", "model.norm."),
)


class FalconH1Mixer(Mamba2Mixer):
    """The Mamba2 mixer with Falcon-H1's muP scaling of its input and projection, its own
    `out_proj` bias and an optional gated norm (see the module docstring)."""

    def __init__(self, config: Any, page: int, tp: TPContext = SINGLE):
        hidden = config.hidden_size
        inter = int(config.mamba_d_ssm or config.mamba_expand * hidden)
        heads = int(config.mamba_n_heads)
        super().__init__(
            hidden, num_heads=heads, head_dim=inter // heads, state_size=int(config.mamba_d_state),
            n_groups=int(config.mamba_n_groups), conv_kernel=int(config.mamba_d_conv),
            conv_bias=bool(config.mamba_conv_bias), proj_bias=bool(config.mamba_proj_bias),
            activation=config.hidden_act, norm_eps=float(config.rms_norm_eps),
            time_step_limit=tuple(config.time_step_limit or (0.0, float("inf"))),
            norm_before_gate=bool(config.mamba_norm_before_gate), page=page, tp=tp)
        self.out_proj = RowParallelLinear(inter, hidden, bool(config.projectors_bias), tp=tp)
        if not config.mamba_rms_norm:
            self.norm = None
            self.gate_act = get_activation("silu")
        self.in_scale = float(config.ssm_in_multiplier)
        groups = self.n_groups * self.state_size
        sizes = (self.inter, self.inter, groups, groups, self.num_heads)  # this rank's z, x, B, C, dt
        scales = [float(m) for m in config.ssm_multipliers]
        if len(scales) != 5:
            raise ValueError(f"config.ssm_multipliers must have 5 entries (z, x, B, C, dt), got {len(scales)}")
        mup = torch.cat([torch.full((n,), m) for n, m in zip(sizes, scales)])  # [I + C + H]
        self.register_buffer("mup", mup, persistent=False)

    def project(self, h: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, I + C + H]
        if self.in_scale != 1.0:
            h = h * self.in_scale
        return self.in_proj(h) * self.mup

    def gated(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [T, I] x 2 -> [T, I]
        if self.norm is None:
            return y * self.gate_act(gate.contiguous())
        return super().gated(y, gate)


class KeyScaledAttention(LlamaAttention):
    """Llama's attention with the keys times `key_multiplier` before RoPE."""

    def __init__(self, *args: Any, key_multiplier: float, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.key_multiplier = float(key_multiplier)

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().qkv_heads(x)
        return q, k * self.key_multiplier, v  # [T, Hkv, D]


class FalconH1MLP(nn.Module):
    """`down(up(x) * act(gate(x) * m0)) * m1` (`mlp_multipliers` m0, m1)."""

    def __init__(self, config: Any, tp: TPContext = SINGLE):
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, bool(config.mlp_bias)
        self.gate_proj = ColumnParallelLinear(hidden, inter, bias, tp=tp)
        self.up_proj = ColumnParallelLinear(hidden, inter, bias, tp=tp)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp=tp)
        self.act = get_activation(config.hidden_act)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in config.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        h = self.up_proj(x) * self.act(self.gate_proj(x) * self.gate_multiplier)  # [T, I]
        return self.down_proj(h) * self.down_multiplier


class FalconH1Layer(HybridLayer):
    """A Falcon-H1 layer: the mixer and attention in parallel, then the MLP."""

    def __init__(self, config: Any, page: int, tp: TPContext = SINGLE):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        head_dim, bias = head_dim_of(config), bool(config.attention_bias)
        self.has_attention = True
        self.self_attn = KeyScaledAttention(
            hidden, config.num_attention_heads, config.num_key_value_heads, head_dim,
            scale=head_dim**-0.5, qkv_bias=bias, o_bias=bias, tp=tp,
            key_multiplier=config.key_multiplier)
        self.mamba = FalconH1Mixer(config, page, tp)
        self.mlp = FalconH1MLP(config, tp)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.attention_in = float(config.attention_in_multiplier)
        self.attention_out = float(config.attention_out_multiplier)
        self.ssm_out = float(config.ssm_out_multiplier)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], caches: list[KVPair],
                metas: list[AttentionMetadata]) -> torch.Tensor:  # [T, H] -> [T, H]
        h = self.input_layernorm(x)  # [T, H]
        m = self.mamba(h, caches[1:], metas[1:]) * self.ssm_out  # [T, H]
        a = self.self_attn(h * self.attention_in, rope, caches[0], metas[0]) * self.attention_out
        x = x + (m + a)
        return x + self.mlp(self.post_attention_layernorm(x))


class FalconH1ForCausalLM(LogitsScaling, HybridCausalLM):
    """Falcon-H1 decoder-only LM on a paged cache (see the module docstring); `tp` makes it this
    rank's shard (attention heads, Mamba heads and groups, MLP)."""

    tied_by_default = False

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        head_dim = head_dim_of(config)
        page = page_of(config, head_dim, tp)
        layers = [FalconH1Layer(config, page, tp) for _ in range(config.num_hidden_layers)]
        self.model = HybridModel(config, layers, head_dim, rope=True,
                                 embedding_multiplier=float(config.embedding_multiplier), tp=tp)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=head_dim, tp=tp)
        self.init_cache(tp.local_kv_heads(config.num_key_value_heads), head_dim)
        self.logit_scale = float(config.lm_head_multiplier)

    def _rename(self, name: str) -> str | None:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return super()._rename(name)
