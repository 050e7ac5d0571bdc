"""Nemotron-H (`NemotronHForCausalLM`, NVIDIA Nemotron-H / Nemotron Nano 2): a stack of one-mixer
blocks, each `x + mixer(norm(x))`, the mixer by `config.layers_block_type[i]`:
- "linear_attention" (pattern "M"): a Mamba2 mixer (`layers.mamba2`);
- "full_attention" ("*"): attention without position embeddings (NoPE: the identity rotation,
  bit for bit), no biases;
- "mlp" ("-"): `down(relu2(up(x)))` (`mlp_hidden_act`, non-gated);
- "moe" ("E"): routed experts of that non-gated MLP (DeepSeek-V3's routing: sigmoid scores, a
  selection-only correction bias, grouped top-k, renormalized, scaled), optionally in a latent
  space (`moe_latent_size`: `fc1_latent_proj` before the experts, `fc2_latent_proj` after), plus
  a shared non-gated MLP on the block's input.

HF's checkpoint names (`backbone.embeddings`, `backbone.layers.{i}.mixer.*`, `backbone.norm_f`)
map onto ours at load (`model.embed_tokens`, the layer's `mamba` / `self_attn` / `mlp`,
`model.norm`); a multi-token-prediction head (`mtp.*`) is skipped. The cache: one entry per
attention block, a mixer's state entries per Mamba block, none for an MLP or MoE block
(`models.mamba_hybrid`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import get_activation
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.layers.mamba2 import Mamba2Mixer
from pagedserve.layers.moe import (
    ExpertPlacement, MoEExperts, MoERouter, MoERouting, expert_param_name, invariant_sigmoid, select_experts)
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.recurrent_state import KVPair
from pagedserve.models.llama import LlamaAttention
from pagedserve.models.mamba_hybrid import HybridCausalLM, HybridLayer, HybridModel, page_of
from pagedserve.platforms import OpsUser

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
_PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
_MIXER_NAME = re.compile(r"^model\.layers\.(\d+)\.mixer\.")
_OURS = {MAMBA: "mamba", ATTENTION: "self_attn", MLP: "mlp", MOE: "mlp"}


def nemotron_h_layer_types(config: Any) -> list[str]:
    """Each block's type (`layers_block_type`, or the older `hybrid_override_pattern`);
    ValueError on one we do not serve."""
    types = list(getattr(config, "layers_block_type", None) or [])
    if not types and (pattern := getattr(config, "hybrid_override_pattern", None)):
        types = [_PATTERN.get(c, c) for c in pattern]
    if not types:
        raise ValueError("config.layers_block_type is missing")
    if unknown := sorted(set(types) - {MAMBA, ATTENTION, MLP, MOE}):
        raise ValueError(f"config.layers_block_type: unsupported block type(s) {unknown}; Nemotron-H has "
                         f"{[MAMBA, ATTENTION, MLP, MOE]}")
    return types


class NemotronHMLP(nn.Module):
    """`down_proj(act(up_proj(x)))` (up column-parallel, down row-parallel)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool,
                 tp: TPContext = SINGLE):
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp=tp)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(self.act(self.up_proj(x)))


class UngatedExperts(MoEExperts):
    """Stacked experts without a gate projection: `down(act(up(x)))` each (`up_proj`,
    `down_proj` as `layers.moe.MoEExperts`'; the torch loop, never the gated kernel)."""

    quantizable = ("up_proj", "down_proj")

    def __init__(self, hidden_size: int, intermediate_size: int, placement: ExpertPlacement, act: str):
        super().__init__(hidden_size, intermediate_size, placement, act=act)
        self.gate_proj = None
        self.act = self.act_module
        self.act_module = None  # (the platform's fused experts are gated: `platforms.cpu`)
        self.act_fn = _ungated

    def expert_forward(self, local: int, x: torch.Tensor, *, down_bias: bool = True) -> torch.Tensor:
        """Local expert `local` on `x` `[n, H]` -> `[n, H]` (model dtype)."""
        up = self.ops.linear(x, self.expert_weight("up_proj", local))  # [n, I]
        return self.ops.linear(self.act(up), self.expert_weight("down_proj", local))


def _ungated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("UngatedExperts runs expert_forward")


class NemotronHMoE(OpsUser, nn.Module):
    """A MoE block (see the module docstring); names as HF's (`gate`, `experts`,
    `shared_experts`, `fc1_latent_proj`, `fc2_latent_proj`). Under tensor parallelism the
    experts' partial sums (sharded intermediate dims, or whole experts per rank) are reduced
    before `fc2_latent_proj`, which every rank holds whole, as `fc1_latent_proj`."""

    is_moe = True  # (LoRA adapts the attention of layers with one of these, lora.layers)

    def __init__(self, config: Any, tp: TPContext = SINGLE, expert_parallel: bool = False):
        super().__init__()
        hidden, bias, act = config.hidden_size, bool(getattr(config, "mlp_bias", False)), config.mlp_hidden_act
        self.tp = tp
        self.routing = MoERouting.from_config(config, scoring="sigmoid", topk_method="noaux_tc",
                                              router_fp32=True)
        num_experts = int(config.n_routed_experts)
        self.placement = ExpertPlacement(num_experts, tp, expert_parallel)
        latent = getattr(config, "moe_latent_size", None)
        width = int(latent or hidden)
        self.gate = MoERouter(hidden, num_experts, self.routing)
        self.experts = UngatedExperts(width, int(config.moe_intermediate_size), self.placement, act)
        self.shared_experts = NemotronHMLP(hidden, int(config.moe_shared_expert_intermediate_size), act, bias,
                                           tp=tp)
        self.fc1_latent_proj = ColumnParallelLinear(hidden, width, bias) if latent else None
        self.fc2_latent_proj = ColumnParallelLinear(width, hidden, bias) if latent else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = select_experts(self.gate(x), self.routing, self.gate.e_score_correction_bias,
                                      lambda v: invariant_sigmoid(v, self.ops))  # [T, k] x 2
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)  # [T, L]
        y = self.tp.all_reduce(self.experts(h, weights, ids)).to(x.dtype)  # [T, L]
        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(y)  # [T, H]
        return y + self.shared_experts(x)


class NemotronHLayer(HybridLayer):
    """One block: `x + mixer(norm(x))`, the mixer `mamba`, `self_attn` or `mlp` (an MLP or
    MoE block's)."""

    def __init__(self, config: Any, kind: str, page: int, tp: TPContext = SINGLE,
                 expert_parallel: bool = False):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.kind = kind
        self.norm = RMSNorm(hidden, eps)
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(
                hidden, num_heads=int(config.mamba_num_heads), head_dim=int(config.mamba_head_dim),
                state_size=int(config.ssm_state_size), n_groups=int(config.n_groups),
                conv_kernel=int(config.conv_kernel), conv_bias=bool(config.use_conv_bias),
                proj_bias=bool(config.use_bias), activation=config.mamba_hidden_act, norm_eps=eps,
                time_step_limit=tuple(config.time_step_limit or (0.0, float("inf"))), page=page, tp=tp)
        elif kind == ATTENTION:
            self.has_attention = True
            head_dim = int(config.head_dim)
            self.self_attn = LlamaAttention(hidden, config.num_attention_heads, config.num_key_value_heads,
                                            head_dim, scale=head_dim**-0.5, tp=tp)
        elif kind == MOE:
            self.mlp = NemotronHMoE(config, tp, expert_parallel)
        else:
            self.mlp = NemotronHMLP(hidden, config.intermediate_size, config.mlp_hidden_act,
                                    bool(getattr(config, "mlp_bias", False)), tp=tp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], caches: list[KVPair],
                metas: list[AttentionMetadata]) -> torch.Tensor:  # [T, H] -> [T, H]
        h = self.norm(x)  # [T, H]
        if self.kind == MAMBA:
            return x + self.mamba(h, caches, metas)
        if self.kind == ATTENTION:
            return x + self.self_attn(h, rope, caches[0], metas[0])
        return x + self.mlp(h)


class NemotronHForCausalLM(HybridCausalLM):
    """Nemotron-H decoder-only LM on a paged cache (see the module docstring); `tp` makes it
    this rank's shard (attention heads, Mamba heads and groups, MLP)."""

    tied_by_default = False

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.kinds = nemotron_h_layer_types(config)
        head_dim = int(config.head_dim)
        page = page_of(config, head_dim, tp)
        expert_parallel = bool(getattr(config, "enable_expert_parallel", False)) and MOE in self.kinds
        self.expert_placement = ExpertPlacement(int(getattr(config, "n_routed_experts", 1) or 1), tp,
                                                expert_parallel)
        layers = [NemotronHLayer(config, kind, page, tp, expert_parallel) for kind in self.kinds]
        self.model = HybridModel(config, layers, head_dim, rope=False, eps=config.layer_norm_epsilon, tp=tp)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=head_dim, tp=tp)
        self.init_cache(tp.local_kv_heads(config.num_key_value_heads), head_dim)

    def _rename(self, name: str) -> str | None:
        if name.startswith("mtp."):  # the multi-token-prediction head: not run
            return None
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        name = name.replace("model.embeddings.", "model.embed_tokens.").replace("model.norm_f.", "model.norm.")
        if m := _MIXER_NAME.match(name):
            name = f"model.layers.{m[1]}.{_OURS[self.kinds[int(m[1])]]}." + name[m.end():]
        name = super()._rename(name)
        return None if name is None else expert_param_name(name, self.expert_placement)
