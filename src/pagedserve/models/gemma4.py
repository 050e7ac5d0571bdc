"""Gemma 4 text decoder (`Gemma4ForCausalLM`, and the text part of
`Gemma4ForConditionalGeneration`), as HF transformers 5's `modeling_gemma4`.

Gemma 3's stack (scaled embeddings, four norms a layer, sliding / full `layer_types`, q/k norms,
a gelu-tanh gated MLP, `final_logit_softcapping`) with:
- norms `x / rms(x) * w` (HF's `Gemma4RMSNorm`; not Gemma 3's `1 + w`), a weightless v norm,
  attention scale 1, and a learned `layer_scalar` multiplying each layer's output;
- full-attention layers of their own head size and KV heads (`global_head_dim`,
  `num_global_key_value_heads`: HF's `per_layer_config`), V = K's projection on them with
  `attention_k_eq_v`, and "proportional" RoPE (`layers.rotary`) per `rope_parameters[type]`;
- per-layer inputs (PLE, `hidden_size_per_layer_input`): a per-layer token embedding plus a
  projection of the embeddings, fed into each layer through a gate after its MLP;
- KV sharing (`num_kv_shared_layers`): the last layers reuse the K/V of the last earlier layer
  of their type and have no cache entries of their own; `use_double_wide_mlp` doubles their MLP;
- MoE layers (`enable_moe_block`): the dense MLP and routed experts side by side, each with its
  own norms, summed (`Gemma4Router`; the experts are `layers.moe.MoEExperts`).
The K/V rows of the two layer types are mapped onto one cache page shape in
`models/gemma4_layers.py` (a layer may take several cache entries).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.kv_spec import FullAttentionSpec, SlidingWindowSpec
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import get_activation
from pagedserve.layers.linear import ColumnParallelLinear, VocabParallelEmbedding
from pagedserve.layers.moe import ExpertPlacement, MoEExperts, expert_param_name
from pagedserve.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.models.base import DecoderStack, KVCache, KVCacheSpec, PagedCausalLM, check_kv_caches
from pagedserve.models.fused_experts import split_fused_experts
from pagedserve.models.gemma3 import FULL, SLIDING, gemma3_layer_types
from pagedserve.models.gemma4_layers import Gemma4Attention, Gemma4Router, _gemma_norm, kv_page_plan
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.multimodal_text import TextOfMultimodal
from pagedserve.platforms import OpsUser


def gemma4_layer_kv(config: Any, index: int, layer_type: str) -> tuple[int, int]:
    """(KV heads, head size) of layer `index`: HF's `per_layer_config[index]` (transformers
    5.25 builds it from `global_head_dim` / `num_global_key_value_heads`), or those attributes
    (full layers; the KV head override only with `attention_k_eq_v`, as HF) on other configs."""
    overrides = getattr(config, "per_layer_config", None)
    if isinstance(overrides, dict):  # (a config read without transformers' per-layer views)
        entry = overrides.get(index, overrides.get(str(index))) or {}
        return (int(entry.get("num_key_value_heads", config.num_key_value_heads)),
                int(entry.get("head_dim", config.head_dim)))
    if overrides is not None:
        # NOTE: transformers refuses the global `num_key_value_heads` / `head_dim` of such a
        # config (AmbiguousGlobalPerLayerAttributeError): each layer's view has them
        layer = overrides[index]
        return int(layer.num_key_value_heads), int(layer.head_dim)
    if layer_type != FULL:
        return int(config.num_key_value_heads), int(config.head_dim)
    kv = getattr(config, "num_global_key_value_heads", None) if getattr(config, "attention_k_eq_v", True) else None
    return int(kv or config.num_key_value_heads), int(getattr(config, "global_head_dim", None) or 512)


def gemma4_kv_sharing(config: Any, types: list[str]) -> list[str | None]:
    """Per layer: "reuse" (a consumer of the last earlier layer of its type), "store" (that
    producer) or None -- HF's `Gemma4TextConfig.kv_sharing_modes`."""
    n, shared = len(types), int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if shared == 0:
        return [None] * n
    first = n - shared
    if first <= 0 or set(types[:first]) != set(types):
        raise ValueError(f"num_kv_shared_layers ({shared}) leaves no earlier layer of every type "
                         "to share the K/V of")
    modes: list[str | None] = [None if i < first else "reuse" for i in range(n)]
    for t in set(types):
        modes[max(i for i in range(first) if types[i] == t)] = "store"
    return modes


def init_per_layer_inputs(model: nn.Module, config: Any, n: int, tp: TPContext = SINGLE) -> None:
    """Give the decoder stack `model` of `n` layers its per-layer inputs (PLE,
    `hidden_size_per_layer_input` wide; `model.ple_width` 0 without): the per-layer token
    embedding, the projection of the embeddings and its norm (HF's names, under `model.`).
    Shared with Gemma 3n (`models.gemma3n`)."""
    model.ple_width = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
    if not model.ple_width:
        return
    hidden, width = config.hidden_size, model.ple_width
    model.ple_vocab = int(config.vocab_size_per_layer_input)
    model.embed_tokens_per_layer = VocabParallelEmbedding(model.ple_vocab, n * width, tp=tp)
    model.ple_embed_scale = nn.Buffer(torch.tensor(width**0.5, dtype=torch.float32), persistent=False)
    model.per_layer_model_projection = ColumnParallelLinear(hidden, n * width, False, part=(0, 1))
    model.per_layer_projection_norm = _gemma_norm(width, config.rms_norm_eps)


def per_layer_inputs(model: nn.Module, input_ids: torch.Tensor, x: torch.Tensor, *,
                     clamp_ids: bool = False) -> torch.Tensor | None:
    """HF's `get_per_layer_inputs` + `project_per_layer_inputs` of a stack set up by
    `init_per_layer_inputs`: `[T, L, P]` of the ids `[T]` and their embeddings `x [T, H]`, or
    None without PLE. `clamp_ids`: ids outside the per-layer table read its row 0 (Gemma 3n,
    whose multimodal ids lie past `vocab_size_per_layer_input`)."""
    if not model.ple_width:
        return None
    t, n, width = x.shape[0], len(model.layers), model.ple_width
    if clamp_ids:
        input_ids = torch.where((input_ids >= 0) & (input_ids < model.ple_vocab), input_ids, 0)  # [T]
    tokens = model.embed_tokens_per_layer(input_ids)  # [T, L * P]
    tokens = (tokens * model.ple_embed_scale.to(tokens.dtype)).view(t, n, width)
    proj = model.per_layer_model_projection(x) * x.shape[-1] ** -0.5  # [T, L * P]
    proj = model.per_layer_projection_norm(proj.view(t, n, width))  # [T, L, P]
    return (proj + tokens) * 2.0**-0.5


class Gemma4DecoderLayer(OpsUser, nn.Module):
    """x + post_attn_norm(attn(input_norm(x))); then the feed-forward part (the dense MLP, or
    with `enable_moe_block` its normed sum with the experts') through its post norm; then the
    per-layer input's gated projection (PLE); all times `layer_scalar`."""

    def __init__(self, config: Any, attn: Gemma4Attention, mlp_width: int,
                 placement: ExpertPlacement | None, tp: TPContext = SINGLE):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = attn
        self.mlp = LlamaMLP(hidden, mlp_width, config.hidden_activation, tp=tp)
        self.input_layernorm = _gemma_norm(hidden, eps)
        self.post_attention_layernorm = _gemma_norm(hidden, eps)
        self.pre_feedforward_layernorm = _gemma_norm(hidden, eps)
        self.post_feedforward_layernorm = _gemma_norm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # (HF: a saved buffer)
        self.ple_width = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.ple_width:
            self.act_fn = get_activation(config.hidden_activation)
            self.per_layer_input_gate = ColumnParallelLinear(hidden, self.ple_width, False, part=(0, 1))
            self.per_layer_projection = ColumnParallelLinear(self.ple_width, hidden, False, part=(0, 1))
            self.post_per_layer_input_norm = _gemma_norm(hidden, eps)
        self.tp = tp
        self.moe = placement is not None
        if self.moe:
            self.router = Gemma4Router(config)
            self.experts = MoEExperts(hidden, int(config.moe_intermediate_size), placement,
                                      act=config.hidden_activation)
            self.post_feedforward_layernorm_1 = _gemma_norm(hidden, eps)
            self.post_feedforward_layernorm_2 = _gemma_norm(hidden, eps)
            self.pre_feedforward_layernorm_2 = _gemma_norm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],
        per_layer_input: torch.Tensor | None,  # [T, P] (PLE) or None
        caches: list[KVCache],
        metas: list[AttentionMetadata],
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # [T, H], this layer's (k, v)
        a, kv = self.self_attn(self.input_layernorm(x), rope, caches, metas, shared_kv)
        x = x + self.post_attention_layernorm(a)  # [T, H]
        h = self.mlp(self.pre_feedforward_layernorm(x))  # [T, H]
        if self.moe:
            weights, ids = self.router(x)  # routed on the residual, as HF
            e = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids,
                             down_bias=self.tp.rank == 0)  # [T, H] fp32 (this rank's part)
            e = self.tp.all_reduce(e).to(x.dtype)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(e)
        x = x + self.post_feedforward_layernorm(h)
        if self.ple_width:
            g = self.act_fn(self.per_layer_input_gate(x)) * per_layer_input  # [T, P]
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar, kv


class Gemma4TextModel(DecoderStack):
    """Scaled embeddings (and per-layer inputs), the decoder layers over their cache entries
    (`cache_entries_of`: several for a wide layer, the producer's for a KV-sharing layer),
    final norm (HF's `model.`)."""

    def __init__(self, config: Any, placement: ExpertPlacement | None, *, tp: TPContext = SINGLE):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise ValueError("Gemma 4 with use_bidirectional_attention='all' (embedding models) is not supported")
        self.layer_types = gemma3_layer_types(config)
        self.modes = gemma4_kv_sharing(config, self.layer_types)
        n = len(self.layer_types)
        dims = [gemma4_layer_kv(config, i, t) for i, t in enumerate(self.layer_types)]
        local = [(tp.local_kv_heads(h), d) for h, d in dims]
        rows = sorted({local[i] for i in range(n) if self.modes[i] != "reuse"})
        self.page, plans = kv_page_plan(rows)
        plan_of = dict(zip(rows, plans))
        k_eq_v = bool(getattr(config, "attention_k_eq_v", False))
        double = bool(getattr(config, "use_double_wide_mlp", False))
        layers, self.cache_entries_of, specs, producer = [], [], [], {}
        for i, t in enumerate(self.layer_types):
            window = config.sliding_window if t == SLIDING else None
            reuse = self.modes[i] == "reuse"
            attn = Gemma4Attention(config, dims[i][0], dims[i][1], window=window,
                                   k_eq_v=k_eq_v and t != SLIDING, shared=reuse, page=self.page,
                                   plan=plan_of[local[i]], tp=tp)
            width = config.intermediate_size * (2 if double and reuse else 1)
            layers.append(Gemma4DecoderLayer(config, attn, width, placement, tp=tp))
            if reuse:
                self.cache_entries_of.append(producer[t])
                continue
            entries = list(range(len(specs), len(specs) + plan_of[local[i]][0]))
            spec = (FullAttentionSpec(1, self.page) if window is None
                    else SlidingWindowSpec(1, self.page, window=window))
            specs += [spec] * len(entries)
            self.cache_entries_of.append(entries)
            producer[t] = entries  # (the last earlier layer of the type: HF's "store" layer)
        self.cache_specs = tuple(specs)
        self.layers = nn.ModuleList(layers)
        hidden = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp=tp)
        self.embed_scale = nn.Buffer(torch.tensor(hidden**0.5, dtype=torch.float32), persistent=False)
        self.norm = _gemma_norm(hidden, config.rms_norm_eps)
        head_dim_of_type = {t: dims[self.layer_types.index(t)][1] for t in set(self.layer_types)}
        self.rotary_emb = nn.ModuleDict({
            t: RotaryEmbedding(head_dim_of_type[t], rope_parameters(config, t), config.max_position_embeddings)
            for t in sorted(head_dim_of_type)})
        init_per_layer_inputs(self, config, n, tp)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        x = x * self.embed_scale.to(x.dtype)  # [T, H]; sqrt(hidden) rounded to the dtype, as HF
        ropes = {t: rope(positions, x.dtype) for t, rope in self.rotary_emb.items()}
        ple = self.per_layer_inputs(input_ids, x)  # [T, L, P] or None
        return x, [(ropes[t], None if ple is None else ple[:, i])
                   for i, t in enumerate(self.layer_types)]

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """HF's `get_per_layer_inputs` + `project_per_layer_inputs`: `[T, L, P]`, or None
        without PLE."""
        return per_layer_inputs(self, input_ids, x)

    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.norm(x)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        check_kv_caches(kv_caches, len(self.cache_specs))
        x, extras = self.embed(input_ids, positions)  # [T, H]
        metas = meta.per_layer or [meta] * len(kv_caches)  # per cache entry (its column's)
        stored: dict[str, tuple] = {}  # the step's K/V of each type's producer (KV sharing)
        for layer, t, mode, extra, entries in zip(self.layers, self.layer_types, self.modes, extras,
                                                  self.cache_entries_of):
            x, kv = layer(x, *extra, [kv_caches[e] for e in entries], [metas[e] for e in entries],
                          stored.get(t) if mode == "reuse" else None)  # [T, H]
            if mode == "store":
                stored[t] = kv
        return self.final(x)


class Gemma4ForCausalLM(PagedCausalLM):
    """Gemma 4 text LM on a paged KV cache (see `pagedserve.models.base.CausalLM` and the
    module docstring); `tp` makes it this rank's shard. Pipeline stages refuse it where its
    cache entries are not its layers (worker/pp_executor.py)."""

    tied_by_default = True

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.moe = bool(getattr(config, "enable_moe_block", False))
        self.expert_placement = (
            ExpertPlacement(int(config.num_experts), tp, bool(getattr(config, "enable_expert_parallel", False)))
            if self.moe else None)
        self.model = Gemma4TextModel(config, self.expert_placement, tp=tp)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=1, head_dim=self.model.page, tp=tp)
        specs = self.model.cache_specs
        self.kv_cache_spec = KVCacheSpec(len(specs), 1, self.model.page, specs)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self._moe_sizes = (config.hidden_size, int(config.moe_intermediate_size)) if self.moe else None
        # a KV-sharing layer's k/v projections and norms, which checkpoints may still hold
        self._unused = tuple(f"model.layers.{i}.self_attn.{m}."
                             for i, mode in enumerate(self.model.modes) if mode == "reuse"
                             for m in ("k_proj", "v_proj", "k_norm", "v_norm"))

    def backbone(self) -> nn.Module:
        return self.model

    def final_softcap(self) -> float | None:
        return self.final_logit_softcapping

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF checkpoint tensors; the experts' fused `gate_up_proj` split (`models.fused_experts`)."""
        if self.moe:
            weights = split_fused_experts(weights, sizes=self._moe_sizes)
        super().load_weights(weights)

    def _rename(self, name: str) -> str | tuple | None:
        name = super()._rename(name)
        if name is None or name.startswith(self._unused):
            return None
        return expert_param_name(name, self.expert_placement) if self.moe else name


class Gemma4ForConditionalGeneration(TextOfMultimodal, Gemma4ForCausalLM):
    """The text decoder of a multimodal Gemma 4 checkpoint (vision and audio towers and their
    embedders skipped; text-only inputs). HF's class applies the text config's final logit
    softcapping too."""

    _SKIP = TextOfMultimodal._SKIP + ("model.audio_tower.", "model.embed_vision.", "model.embed_audio.")

