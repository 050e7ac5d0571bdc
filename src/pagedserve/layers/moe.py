"""Mixture-of-experts (MoE) feed-forward layer: a router picks `top_k` of `num_experts` gated MLPs
per token; the token's output is their weighted sum (plus an optional shared expert).

- `MoERouting`: the routing rules as plain data (softmax / sigmoid scores, top-k, grouped top-k,
  renormalization, the correction bias used for selection only, the routed scaling factor,
  gpt-oss's softmax over the selected logits, Phi-3.5-MoE's sparsemixer, Llama 4's sigmoid of the
  selected logits weighing the expert's input).
  `MoERouting.from_config` reads HF config fields; a family with other rules builds one itself.
  `select_experts(logits, routing, bias)` applies it.
- `ExpertPlacement`: which experts this rank holds: all of them, each sharded along the
  intermediate dimension (tensor parallelism), or whole experts split across the ranks
  (`expert_parallel`: vLLM's `--enable-expert-parallel`).
- `MoEExperts`: the experts' weights stacked, `gate_proj` / `up_proj` `[E, I, H]` and `down_proj`
  `[E, H, I]` (optional biases `[E, I]` / `[E, H]`), bf16 / fp32, or kept quantized as the
  stacked blocks of a GGUF file (uint8 `[E, N, row_bytes]` with a `QuantSpec`); tokens are
  grouped by expert and each expert's gate / up / down run over its routed tokens only.
- `FusedMoE`: router + experts + optional shared expert (Qwen2-MoE's, with its sigmoid gate;
  DeepSeek's plain one), as a model's `mlp` module.

Checkpoints name experts one by one (`...experts.3.w1.weight`, `...experts.3.gate_proj.weight`);
`expert_param_name` maps such a name to `(stacked parameter, local index)` for
`layers.weights.load_named_weights`, which copies it into that slice; a whole stacked tensor
(GGUF's `ffn_gate_exps`) loads under the stacked name.

NOTE: the weighted sum is accumulated in float32 per token in ascending expert order (as HF's
loop over experts does), and every product goes through the layer's `ops.linear`, so a token's
result does not depend on the other tokens of its batch (float32 on the CPU platform: the
batch-invariant kernels).
"""

from __future__ import annotations

import dataclasses

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import get_activation
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear, ShardSpec, set_shard
from pagedserve.platforms import OpsUser

SCORINGS = ("softmax", "sigmoid", "softmax_topk", "sparsemixer", "sigmoid_topk")
GROUP_RULES = ("none", "max", "top2_sum")


@dataclass(frozen=True)
class MoERouting:
    """How a token's experts and their weights follow from the router's logits `[T, E]`.

    - `scoring`: "softmax" (scores = softmax over all experts, Mixtral / Qwen / OLMoE /
      DeepSeek-V2), "sigmoid" (DeepSeek-V3), "softmax_topk" (gpt-oss: the top-k *logits* are
      chosen, their weights are the softmax over those k alone), or "sparsemixer" (Phi-3.5-MoE,
      top-2 only: see `sparsemixer`; `jitter_eps` is its HF `router_jitter_noise`), or
      "sigmoid_topk" (Llama 4: the top-k *logits* are chosen, their weights are their sigmoids;
      with `renormalize` divided by their sum, no epsilon: Cohere 2 MoE).
    - `renormalize`: the k chosen scores divided by their sum (HF `norm_topk_prob`); for sigmoid
      scores `renormalize_eps` is added to the sum (DeepSeek-V3: 1e-20).
    - grouped top-k: the experts form `num_groups` equal groups; only experts of the
      `topk_groups` best groups may be chosen. `group_rule`: "max" (a group's score is its best
      expert's: DeepSeek-V2's "group_limited_greedy"; others masked to 0) or "top2_sum" (the sum
      of its two best, with the correction bias: DeepSeek-V3's "noaux_tc"; others masked to -inf).
    - `correction_bias`: the router holds `e_score_correction_bias` `[E]`, added to the scores to
      *choose* experts only (the weights are the unbiased scores).
    - `routed_scaling_factor`: the final weights are multiplied by it.
    - `router_bias`: the router's linear has a bias (gpt-oss).
    - `router_fp32`: the router weight is kept in float32 and the logits computed in float32
      whatever the model dtype (DeepSeek).
    - `weight_on_input`: the weight scales the routed expert's *input* (`expert(x * w)`, cast to
      the model dtype first), its output is added unweighted (Llama 4; vLLM's
      `apply_router_weight_on_input`). Top-1 only: see `FusedMoE.forward`.
    """

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    renormalize_eps: float = 0.0
    num_groups: int = 1
    topk_groups: int = 1
    group_rule: str = "none"
    correction_bias: bool = False
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    router_fp32: bool = False
    jitter_eps: float = 0.0
    weight_on_input: bool = False

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"num_experts_per_tok must be >= 1, got {self.top_k}")
        if self.weight_on_input and self.top_k != 1:
            raise ValueError("routing weights on the experts' input are implemented for one expert "
                             f"per token, got num_experts_per_tok {self.top_k}")
        if self.scoring == "sparsemixer" and self.top_k != 2:
            raise ValueError(f"sparsemixer routing picks 2 experts per token, got num_experts_per_tok {self.top_k}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoE scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.group_rule not in GROUP_RULES:
            raise ValueError(f"MoE group rule must be one of {GROUP_RULES}, got {self.group_rule!r}")
        if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group ({self.topk_groups}) must be in [1, n_group "
                             f"({self.num_groups})]")

    @classmethod
    def from_config(cls, config: Any, *, scoring: str = "softmax", topk_method: str = "greedy",
                    **overrides: Any) -> "MoERouting":
        """The routing an HF config describes by its common fields (`num_experts_per_tok`,
        `norm_topk_prob`, `scoring_func`, `topk_method`, `n_group`, `topk_group`,
        `routed_scaling_factor`). `scoring` / `topk_method` are the family's defaults where the
        config has no `scoring_func` / `topk_method` (HF's DeepSeek-V3 config has neither: its
        model passes "sigmoid" / "noaux_tc"); `overrides` set any field outright (e.g. Mixtral
        always renormalizes). ValueError naming an unknown `scoring_func` / `topk_method`."""
        scoring = getattr(config, "scoring_func", None) or scoring
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported MoE scoring_func {scoring!r}; supported: softmax, sigmoid")
        method = getattr(config, "topk_method", None) or topk_method
        rules = {"greedy": "none", "group_limited_greedy": "max", "noaux_tc": "top2_sum"}
        if method not in rules:
            raise ValueError(f"unsupported MoE topk_method {method!r}; supported: {', '.join(rules)}")
        groups = int(getattr(config, "n_group", None) or 1) if method != "greedy" else 1
        kwargs = dict(
            top_k=int(config.num_experts_per_tok),
            scoring=scoring,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            num_groups=groups,
            topk_groups=int(getattr(config, "topk_group", None) or 1) if groups > 1 else 1,
            group_rule=rules[method] if groups > 1 else "none",
            correction_bias=method == "noaux_tc",
            renormalize_eps=1e-20 if scoring == "sigmoid" else 0.0,
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
        )
        kwargs.update(overrides)
        return cls(**kwargs)


def select_experts(
    logits: torch.Tensor,  # [T, E] router logits (any float dtype)
    routing: MoERouting,
    correction_bias: torch.Tensor | None = None,  # [E], routing.correction_bias
    sigmoid: Callable[[torch.Tensor], torch.Tensor] = torch.sigmoid,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, expert ids [T, k] int64
    """Each token's `routing.top_k` experts and their weights, by `routing`'s rules (HF's
    routers, operation for operation, in float32). `sigmoid`: the sigmoid scoring's function
    (`FusedMoE` passes its batch-invariant one, `invariant_sigmoid`)."""
    k = routing.top_k
    logits = logits.float()  # [T, E]
    if routing.scoring == "sparsemixer":
        weights, ids = sparsemixer(logits, routing.jitter_eps)  # [T, 2]
    elif routing.scoring == "softmax_topk":
        top, ids = torch.topk(logits, k, dim=-1)  # [T, k]
        weights = torch.softmax(top, dim=-1)
    elif routing.scoring == "sigmoid_topk":
        top, ids = torch.topk(logits, k, dim=-1)  # [T, k]
        weights = sigmoid(top)  # [T, k]
        if routing.renormalize:  # (Cohere 2 MoE's sigmoid selection with norm_topk_prob)
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = torch.softmax(logits, dim=-1) if routing.scoring == "softmax" else sigmoid(logits)
        choice = scores if correction_bias is None else scores + correction_bias.float()  # [T, E]
        if routing.num_groups > 1:
            t, e = choice.shape
            grouped = choice.view(t, routing.num_groups, e // routing.num_groups)  # [T, G, E/G]
            if routing.group_rule == "max":
                group_scores = grouped.max(dim=-1).values  # [T, G]
            else:
                group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            group_ids = torch.topk(group_scores, routing.topk_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0).bool()  # [T, G]
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(t, e)  # [T, E]
            fill = 0.0 if routing.group_rule == "max" else float("-inf")
            choice = choice.masked_fill(~keep, fill)
        ids = torch.topk(choice, k, dim=-1)[1]  # [T, k]
        weights = scores.gather(1, ids)  # [T, k]
        if routing.renormalize:
            total = weights.sum(dim=-1, keepdim=True)  # [T, 1]
            weights = weights / (total + routing.renormalize_eps if routing.renormalize_eps else total)
    if routing.routed_scaling_factor != 1.0:
        weights = weights * routing.routed_scaling_factor
    return weights, ids


def sparsemixer(
    logits: torch.Tensor,  # [T, E] fp32 router logits
    jitter_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, 2] fp32, expert ids [T, 2] int64
    """Phi-3.5-MoE's inference routing (HF's `sparsemixer` with `training=False`): two rounds,
    each picking the best logit still available and weighing it by its softmax among the
    logits *near* it only.

    Round r takes `top` (the best logit not yet chosen) and drops every expert whose relative
    gap `(top - s) / max(|s|, top)` exceeds `2 * jitter_eps` (and, in round 2, the round-1
    expert), then weighs `top`'s expert by the softmax over what is left.
    NOTE: unlike "softmax" + renormalize, the weights are not a split of one softmax: each is
    its own round's masked softmax (near-ties share weight; a clear winner gets ~1 in round 1
    and the runner-up ~1 in round 2), and the two need not sum to 1. The gap is measured
    against the *unmasked* logits in both rounds, as HF does."""
    weights, ids = [], []
    available = logits  # [T, E]: round 2 without the round-1 expert
    for _ in range(2):
        top, idx = available.max(dim=-1, keepdim=True)  # [T, 1]
        factor = logits.abs().clamp(min=top)  # [T, E]
        far = ((top - logits) / factor) > 2 * jitter_eps  # [T, E]
        gates = torch.softmax(available.masked_fill(far, float("-inf")), dim=-1)  # [T, E]
        weights.append(gates.gather(-1, idx))
        ids.append(idx)
        available = available.scatter(-1, idx, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


def invariant_sigmoid(x: torch.Tensor, ops) -> torch.Tensor:
    """`torch.sigmoid(x)` on the platform's one-formula kernel (`ops.activation`), else torch's.
    NOTE: torch's CPU sigmoid computes most elements in vectors and a tensor's last few with
    scalar code, whose bits differ: a token's gate `[T, 1]` (or scores `[T, E]`, E not a multiple
    of the vector width) would then depend on how many tokens share its step."""
    if x.dtype in (torch.float32, torch.bfloat16):
        y = ops.activation(x.contiguous(), "sigmoid")
        if y is not None:
            return y
    return torch.sigmoid(x)


@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts rank `tp.rank` holds. Without `expert_parallel`, all `num_experts`, each
    sharded along its intermediate dimension over the ranks (gate / up by output rows, down by
    input columns). With it, the contiguous range `[start, stop)` of whole experts (vLLM's
    linear placement); `num_experts` must divide by the world size."""

    num_experts: int
    tp: TPContext = SINGLE
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.expert_parallel and self.num_experts % self.tp.world_size:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by "
                             f"tensor_parallel_size ({self.tp.world_size}) with expert parallelism")

    @property
    def ep(self) -> bool:
        """Whole experts split across ranks (more than one rank, expert_parallel)."""
        return self.expert_parallel and self.tp.is_parallel

    @property
    def start(self) -> int:
        return self.tp.rank * self.num_local if self.ep else 0

    @property
    def num_local(self) -> int:
        return self.num_experts // self.tp.world_size if self.ep else self.num_experts

    def local(self, expert: int) -> int | None:
        """The local index of global expert `expert`, None when another rank holds it."""
        i = expert - self.start
        return i if 0 <= i < self.num_local else None

    @property
    def shard_tp(self) -> TPContext:
        """The context the experts' intermediate dimension is sharded over (SINGLE under expert
        parallelism: each rank's experts are whole)."""
        return SINGLE if self.ep else self.tp


def swiglu(act: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`(gate, up) -> act(gate) * up`: the gated activation of Llama-style MLPs."""

    def fn(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return act(gate) * up

    return fn


class MoEExperts(OpsUser, nn.Module):
    """This rank's experts, stacked: `gate_proj` / `up_proj` `[E_local, I_local, H]`, `down_proj`
    `[E_local, H, I_local]`, with optional biases (`gate_proj_bias` / `up_proj_bias`
    `[E_local, I_local]`, `down_proj_bias` `[E_local, H]`).

    `act`: an HF activation name (gated as `act(gate) * up`), or a callable `(gate, up) -> h`
    for other gated activations (gpt-oss's clamped SwiGLU). The stacked weights may be replaced
    by quantized blocks (`layers.quantization`: uint8 `[E, N, row_bytes]` with a `QuantSpec`).
    """

    # the stacked weights `layers.quantization` may replace by their blocks
    quantizable = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, hidden_size: int, intermediate_size: int, placement: ExpertPlacement, *,
                 act: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = "silu",
                 bias: bool = False) -> None:
        super().__init__()
        tp = placement.shard_tp
        self.tp = tp  # the sharding of the intermediate dimension (not the all-reduce's)
        self.placement = placement
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        inter = tp.split(intermediate_size, "moe_intermediate_size")
        e = placement.num_local
        self.gate_proj = nn.Parameter(torch.empty(e, inter, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(e, inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, inter))
        self.gate_proj_bias = nn.Parameter(torch.empty(e, inter)) if bias else None
        self.up_proj_bias = nn.Parameter(torch.empty(e, inter)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden_size)) if bias else None
        if tp.is_parallel:
            rows = ((tp.rank * inter, (tp.rank + 1) * inter),)
            for p in (self.gate_proj, self.up_proj):
                set_shard(p, ShardSpec(1, rows, intermediate_size))
            set_shard(self.down_proj, ShardSpec(2, rows, intermediate_size))
            set_shard(self.gate_proj_bias, ShardSpec(1, rows, intermediate_size))
            set_shard(self.up_proj_bias, ShardSpec(1, rows, intermediate_size))
        if isinstance(act, str):
            self.act_name = act
            self.act_module = get_activation(act)  # an OpsUser submodule: bound with the model
            self.act_fn = swiglu(self.act_module)
        else:
            self.act_name, self.act_fn = None, act

    def expert_weight(self, name: str, index: int) -> torch.Tensor:
        """Local expert `index`'s 2-D weight `name` ("gate_proj" | "up_proj" | "down_proj"): a
        view of the stacked tensor, carrying its `quant` spec when quantized (with the expert's
        own input order where the stack's `perm` is `[E, K]`: GPTQ act-order)."""
        stacked = getattr(self, name)
        w = stacked[index]
        spec = getattr(stacked, "quant", None)
        if spec is not None:
            if spec.perm is not None and spec.perm.dim() == 2:
                spec = dataclasses.replace(spec, perm=spec.perm[index])
            w.quant = spec
        return w

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        weights: torch.Tensor,  # [T, k] fp32 routing weights
        ids: torch.Tensor,  # [T, k] int64 global expert ids
        *,
        down_bias: bool = True,
    ) -> torch.Tensor:  # [T, H] fp32: this rank's part of the weighted sum
        """`sum_j weights[t, j] * expert_{ids[t, j]}(x[t])` over this rank's experts, per token
        in ascending expert order, accumulated in float32. `down_bias`: add the down projection's
        bias (one rank only, when the result is summed over ranks)."""
        t, k = ids.shape
        if t:
            fused = self.ops.moe_experts(self, x, weights, ids, down_bias)
            if fused is not None:
                return fused
        out = torch.zeros(t, self.hidden_size, dtype=torch.float32, device=x.device)  # [T, H]
        if t == 0:
            return out
        flat = ids.reshape(-1)  # [T*k]
        order = torch.argsort(flat, stable=True)  # [T*k] slots by expert, tokens ascending
        counts = torch.bincount(flat, minlength=self.placement.num_experts).tolist()
        tokens = order // k  # [T*k] the token of each sorted slot
        slot_weights = weights.reshape(-1)[order]  # [T*k]
        start, offset = self.placement.start, 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            lo, offset = offset, offset + count
            local = expert - start
            if not 0 <= local < self.placement.num_local:
                continue
            rows = tokens[lo:offset]  # [n] tokens routed to this expert, ascending
            xe = x[rows]  # [n, H]
            y = self.expert_forward(local, xe, down_bias=down_bias)  # [n, H]
            # NOTE: not index_add_: it took ~15 ms a call on CPU (its parallel path) at any size;
            # an expert holds a token at most once, so gather-add-scatter is the same sum
            out[rows] = out[rows] + y.float() * slot_weights[lo:offset, None]  # [n, H]
        return out

    def expert_forward(self, local: int, x: torch.Tensor, *, down_bias: bool = True) -> torch.Tensor:
        """Local expert `local`'s gated MLP on `x` `[n, H]` -> `[n, H]` (model dtype)."""
        gb = None if self.gate_proj_bias is None else self.gate_proj_bias[local]
        ub = None if self.up_proj_bias is None else self.up_proj_bias[local]
        db = None if self.down_proj_bias is None or not down_bias else self.down_proj_bias[local]
        gate = self.ops.linear(x, self.expert_weight("gate_proj", local), gb)  # [n, I]
        up = self.ops.linear(x, self.expert_weight("up_proj", local), ub)  # [n, I]
        return self.ops.linear(self.act_fn(gate, up), self.expert_weight("down_proj", local), db)

    def extra_repr(self) -> str:
        p = self.placement
        return (f"experts={p.num_local}/{p.num_experts} (from {p.start}), hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, act={self.act_name or 'custom'}")


class MoERouter(OpsUser, nn.Module):
    """The router: `logits = x W^T (+ b)` `[T, E]` over every expert (replicated on each rank),
    with the selection-only `e_score_correction_bias` `[E]` when the routing has one."""

    def __init__(self, hidden_size: int, num_experts: int, routing: MoERouting) -> None:
        super().__init__()
        dtype = torch.float32 if routing.router_fp32 else None
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype)) if routing.router_bias else None
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts, dtype=torch.float32)) if routing.correction_bias else None)
        self.routing = routing

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, E]
        if self.routing.router_fp32:
            x = x.float()
        return self.ops.linear(x, self.weight, self.bias)


class SharedExpert(OpsUser, nn.Module):
    """A plain gated MLP beside the routed experts (Qwen2-MoE's `shared_expert`, DeepSeek's
    `shared_experts`), sharded like a dense MLP; `forward` returns this rank's partial sum of
    the down projection (the MoE layer reduces it with the experts'). `bias`: the three
    projections have biases (ERNIE 4.5's `use_bias`; the down one added on rank 0 only)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, *, bias: bool = False,
                 tp: TPContext = SINGLE):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, tp=tp)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp=tp)
        self.act_fn = get_activation(act)
        self.down_bias_here = bias and tp.rank == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H] (partial over ranks)
        h = self.act_fn(self.gate_proj(x)) * self.up_proj(x)  # [T, I / N]
        return self.ops.linear(h, self.down_proj.weight, self.down_proj.bias if self.down_bias_here else None)


class FusedMoE(OpsUser, nn.Module):
    """An MoE feed-forward block (see the module docstring): `forward(x [T, H]) -> [T, H]`.

    Submodules (parameter names): `gate` (the router: `gate.weight`, `gate.bias`,
    `gate.e_score_correction_bias`), `experts` (`experts.gate_proj`, ...), optional
    `shared_expert` (`shared_expert.{gate,up,down}_proj.weight`) and `shared_expert_gate`
    (`[1, H]`: the shared output scaled by `sigmoid(x . w)`, Qwen2-MoE).

    Under tensor parallelism every rank routes every token; the experts' partial sums (sharded
    intermediate dims, or this rank's whole experts with `expert_parallel`) and the shared
    expert's are summed over the ranks in one all-reduce.
    """

    is_moe = True  # (LoRA adapts the attention of layers with one of these as `mlp`, lora.layers)

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        routing: MoERouting,
        *,
        act: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = "silu",
        expert_bias: bool = False,
        shared_intermediate_size: int = 0,
        shared_act: str = "silu",
        shared_gate: bool = False,
        shared_bias: bool = False,
        tp: TPContext = SINGLE,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        if routing.top_k > num_experts:
            raise ValueError(f"num_experts_per_tok ({routing.top_k}) must be <= the number of "
                             f"experts ({num_experts})")
        if num_experts % routing.num_groups:
            raise ValueError(f"the number of experts ({num_experts}) must be divisible by n_group "
                             f"({routing.num_groups})")
        self.tp = tp
        self.routing = routing
        self.num_experts = num_experts
        self.placement = ExpertPlacement(num_experts, tp, expert_parallel)
        self.gate = MoERouter(hidden_size, num_experts, routing)
        self.experts = MoEExperts(hidden_size, intermediate_size, self.placement, act=act,
                                  bias=expert_bias)
        self.shared_expert = (SharedExpert(hidden_size, shared_intermediate_size, shared_act,
                                           bias=shared_bias, tp=tp)
                              if shared_intermediate_size else None)
        self.shared_expert_gate = (nn.Linear(hidden_size, 1, bias=False)
                                   if shared_intermediate_size and shared_gate else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        logits = self.gate(x)  # [T, E]
        weights, ids = select_experts(logits, self.routing, self.gate.e_score_correction_bias,
                                      lambda v: invariant_sigmoid(v, self.ops))
        routed_in = x
        if self.routing.weight_on_input:
            # NOTE: exact for one expert per token only (MoERouting refuses more): the token's
            # input scaled by its one weight (in the model dtype, as HF's Llama 4), then that
            # expert's output weighed by exactly 1 (x * 1.0 is x: the weighted sum is the output)
            routed_in = x * weights.to(x.dtype)  # [T, H] * [T, 1]
            weights = torch.ones_like(weights)  # [T, 1]
        y = self.experts(routed_in, weights, ids, down_bias=self.tp.rank == 0)  # [T, H] fp32
        if self.shared_expert is not None:
            s = self.shared_expert(x)  # [T, H]
            if self.shared_expert_gate is not None:
                s = invariant_sigmoid(self.ops.linear(x, self.shared_expert_gate.weight), self.ops) * s
            y = y + s.float()
        return self.tp.all_reduce(y).to(x.dtype)  # summed in float32 over the ranks


# --- checkpoint names ----------------------------------------------------------------------------

_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<leaf>\w+)\.(?P<kind>weight|bias)$")

_STACKED_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<leaf>gate_proj|up_proj|down_proj)\.(?P<kind>weight|bias)$")

# per-expert checkpoint leaves -> our stacked parameter (Mixtral's w1 / w3 / w2; the rest's names)
EXPERT_LEAVES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
                 "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


def expert_param_name(name: str, placement: ExpertPlacement) -> str | tuple | None:
    """Map a checkpoint name onto the stacked experts' parameters, for
    `layers.weights.load_named_weights`:

    - a per-expert name (`<prefix>.experts.<e>.<w1|w3|w2|gate_proj|up_proj|down_proj>.<weight|bias>`)
      -> `(<prefix>.experts.<gate_proj|...>[_bias], local index of e)`, or None when another
      rank holds expert e;
    - a whole stacked tensor (`<prefix>.experts.gate_proj[.weight]`, from a GGUF file's
      `ffn_*_exps`) -> our stacked name; under expert parallelism `(that name, this rank's range
      of experts)`;
    - any other name unchanged."""
    m = _EXPERT_NAME.match(name)
    if m is not None and m["leaf"] in EXPERT_LEAVES:
        local = placement.local(int(m["index"]))
        if local is None:
            return None
        leaf = EXPERT_LEAVES[m["leaf"]] + ("_bias" if m["kind"] == "bias" else "")
        return f"{m['prefix']}.{leaf}", local
    m = _STACKED_NAME.match(name)
    if m is not None:  # `...experts.gate_proj.weight` (llama.cpp's merged name) -> ours
        name = f"{m['prefix']}.{m['leaf']}" + ("_bias" if m["kind"] == "bias" else "")
    prefix, _, leaf = name.rpartition(".")
    if placement.ep and prefix.endswith(".experts") and leaf.removesuffix("_bias") in EXPERT_LEAVES.values():
        return name, slice(placement.start, placement.start + placement.num_local)
    return name
