"""Gemma 3n text decoder (`Gemma3nForCausalLM`, and the text part of
`Gemma3nForConditionalGeneration`), as HF transformers 5's `modeling_gemma3n`.

Gemma 4's E-series attention (`x / rms(x) * w` norms, q/k norms and a weightless v norm,
attention scale 1, sliding / full `layer_types`, KV sharing over the last `num_kv_shared_layers`,
per-layer inputs: `models.gemma4`, `models.gemma4_layers`) inside a different residual stream:
- AltUp (`altup_num_inputs` streams, `[N, T, H]`): the embeddings and `N - 1` projections of
  them (rescaled to the embeddings' RMS) enter the stack; each layer predicts every stream from
  all of them (coefficients from a router on stream `altup_active_idx`), runs on the active
  prediction, and corrects every prediction by the layer's innovation; the per-layer input
  (PLE) gated by the corrected active stream is added to streams 1.. . At the end the streams
  are projected back, rescaled, averaged and normed. (`altup_coef_clip` clips the
  coefficients in training only, as HF.)
- Laurel: a low-rank residual (`laurel_rank`) of the normed input, added with the attention
  output, the sum over sqrt(2);
- activation sparsity (`activation_sparsity_pattern`, per layer): the MLP's gate keeps what
  lies above `mean + std * icdf(sparsity)` of its row (a gaussian top-k);
- per-layer MLP widths (`intermediate_size` a list), final logit softcapping.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.kv_spec import FullAttentionSpec, SlidingWindowSpec
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.activation import get_activation
from pagedserve.layers.linear import ColumnParallelLinear, VocabParallelEmbedding, linear_outputs
from pagedserve.layers.norms import WeightlessRMSNorm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.base import DecoderStack, KVCache, KVCacheSpec, PagedCausalLM, check_kv_caches
from pagedserve.models.gemma3 import SLIDING, gemma3_layer_types, gemma3_rope_parameters
from pagedserve.models.gemma4 import gemma4_kv_sharing, init_per_layer_inputs, per_layer_inputs
from pagedserve.models.gemma4_layers import Gemma4Attention, _gemma_norm, kv_page_plan
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.multimodal_text import TextOfMultimodal
from pagedserve.platforms import OpsUser


def _replicated(n_in: int, n_out: int) -> ColumnParallelLinear:
    """A bias-free linear every tensor-parallel rank holds whole."""
    return ColumnParallelLinear(n_in, n_out, False, part=(0, 1))


def gaussian_std_multiplier(sparsity: float) -> torch.Tensor:
    """`icdf(sparsity)` of the standard normal as HF computes it (`Normal(0, 1).icdf` of a
    float32 tensor), once on the CPU: a 0-d float32 tensor. ValueError outside [0, 1)."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"activation_sparsity_pattern values must lie in [0, 1), got {sparsity}")
    p = torch.tensor(sparsity, dtype=torch.float32)
    return torch.distributions.normal.Normal(0, 1).icdf(p)  # sqrt(2) * erfinv(2p - 1), float32


class Gemma3nMLP(LlamaMLP):
    """The gated MLP; with a sparsity `s > 0` the gate keeps, per row, `relu(g - cutoff)` with
    `cutoff = mean(g) + std(g) * icdf(s)` (HF's `_gaussian_topk`; a whole row: tensor
    parallelism refuses it)."""

    def __init__(self, hidden: int, width: int, act: str, sparsity: float, *, tp: TPContext = SINGLE):
        super().__init__(hidden, width, act, tp=tp)
        self.sparsity = float(sparsity)
        if self.sparsity > 0.0 and tp.is_parallel:
            raise ValueError("Gemma 3n's activation_sparsity_pattern needs whole MLP rows: "
                             "tensor_parallel_size > 1 is not supported")
        self.std_multiplier = (nn.Buffer(gaussian_std_multiplier(self.sparsity), persistent=False)
                               if self.sparsity > 0.0 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if self.std_multiplier is None:
            return super().forward(x)
        gate, up = linear_outputs(x, self.fusable_linears()[0])  # [T, I] each
        mean = gate.mean(-1, keepdim=True)  # [T, 1]
        std = gate.std(-1, keepdim=True, unbiased=False)  # [T, 1]
        cutoff = mean + std * self.std_multiplier.to(gate.dtype)  # [T, 1]
        gate = torch.relu(gate - cutoff)  # [T, I]
        return self.down_proj(self.act_fn(gate) * up)


class Gemma3nLaurel(nn.Module):
    """Learned augmented residual: `x + norm(right(left(x)))`, `left` of rank `laurel_rank`."""

    def __init__(self, config: Any):
        super().__init__()
        self.linear_left = _replicated(config.hidden_size, int(config.laurel_rank))
        self.linear_right = _replicated(int(config.laurel_rank), config.hidden_size)
        self.post_laurel_norm = _gemma_norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


class Gemma3nAltUp(nn.Module):
    """AltUp's predict / correct over the `N` streams `[N, T, H]` (HF's `Gemma3nTextAltUp`).
    The coefficient mixes are sums over the streams in stream order (per token: no batch-
    dependent arithmetic)."""

    def __init__(self, config: Any):
        super().__init__()
        hidden, n = config.hidden_size, int(config.altup_num_inputs)
        self.n, self.active = n, int(config.altup_active_idx)
        self.correct_output_scale = nn.Parameter(torch.zeros(hidden))
        self.correction_coefs = _replicated(n, n)
        self.prediction_coefs = _replicated(n, n * n)
        self.modality_router = _replicated(hidden, n)
        self.router_norm = _gemma_norm(hidden, config.rms_norm_eps)
        self.router_input_scale = hidden**-1.0

    def modalities(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, N]
        routed = self.modality_router(self.router_norm(x) * self.router_input_scale)  # [T, N]
        return torch.tanh(routed.float()).to(x.dtype)

    def predict(self, xs: torch.Tensor) -> torch.Tensor:  # [N, T, H] -> [N, T, H]
        t = xs.shape[1]
        coefs = self.prediction_coefs(self.modalities(xs[self.active])).view(t, self.n, self.n)  # [T, j, i]
        preds = []
        for j in range(self.n):  # prediction j = sum_i c[j, i] x_i, plus x_j
            mix = xs[0] * coefs[:, j, 0:1]  # [T, H]
            for i in range(1, self.n):
                mix = mix + xs[i] * coefs[:, j, i:i + 1]
            preds.append(mix + xs[j])
        return torch.stack(preds)  # [N, T, H]

    def correct(self, preds: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:  # -> [N, T, H]
        coefs = self.correction_coefs(self.modalities(activated)) + 1.0  # [T, N]
        innovation = activated - preds[self.active]  # [T, H]
        return torch.stack([innovation * coefs[:, j:j + 1] + preds[j] for j in range(self.n)])

    def scale_corrected_output(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return (x.to(self.correct_output_scale.dtype) * self.correct_output_scale).to(x.dtype)


class Gemma3nDecoderLayer(OpsUser, nn.Module):
    """One layer over the AltUp streams: predict; on the active prediction, attention and
    Laurel side by side (their sum over sqrt(2)), the (sparse) MLP; correct; the per-layer
    input gated by the corrected active stream (scaled with `altup_correct_scale`) added to
    streams 1.. ."""

    def __init__(self, config: Any, attn: Gemma4Attention, index: int, tp: TPContext = SINGLE):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = attn
        width = config.intermediate_size
        width = int(width[index] if isinstance(width, (list, tuple)) else width)
        sparsity = getattr(config, "activation_sparsity_pattern", None) or 0.0
        sparsity = float(sparsity[index] if isinstance(sparsity, (list, tuple)) else sparsity)
        self.mlp = Gemma3nMLP(hidden, width, config.hidden_activation, sparsity, tp=tp)
        self.input_layernorm = _gemma_norm(hidden, eps)
        self.post_attention_layernorm = _gemma_norm(hidden, eps)
        self.pre_feedforward_layernorm = _gemma_norm(hidden, eps)
        self.post_feedforward_layernorm = _gemma_norm(hidden, eps)
        self.altup = Gemma3nAltUp(config)
        self.laurel = Gemma3nLaurel(config)
        self.correct_scale = bool(getattr(config, "altup_correct_scale", True))
        ple = int(config.hidden_size_per_layer_input)
        self.act_fn = get_activation(config.hidden_activation)
        self.per_layer_input_gate = _replicated(hidden, ple)
        self.per_layer_projection = _replicated(ple, hidden)
        self.post_per_layer_input_norm = _gemma_norm(hidden, eps)

    def forward(
        self,
        xs: torch.Tensor,  # [N, T, H]
        rope: tuple[torch.Tensor, torch.Tensor],
        per_layer_input: torch.Tensor,  # [T, P]
        caches: list[KVCache],
        metas: list[AttentionMetadata],
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:  # [N, T, H], this layer's (k, v)
        preds = self.altup.predict(xs)  # [N, T, H]
        active = preds[self.altup.active]  # [T, H]
        normed = self.input_layernorm(active)
        laurel = self.laurel(normed)  # [T, H]
        a, kv = self.self_attn(normed, rope, caches, metas, shared_kv)
        h = (active + self.post_attention_layernorm(a) + laurel) / math.sqrt(2)  # [T, H]
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        corrected = self.altup.correct(preds, h)  # [N, T, H]
        first = corrected[self.altup.active]
        if self.correct_scale:
            first = self.altup.scale_corrected_output(first)
        g = self.act_fn(self.per_layer_input_gate(first)) * per_layer_input  # [T, P]
        p = self.post_per_layer_input_norm(self.per_layer_projection(g))  # [T, H]
        return torch.cat([corrected[:1], corrected[1:] + p]), kv


def _rescaled(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # [T, H], [T, 1]
    """`x` scaled to the RMS `target` (its own RMS floored at sqrt(1e-5)), as HF's stream
    projections."""
    rms = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))  # [T, 1]
    return x * target / rms


class Gemma3nMultimodalTokens(nn.Module):
    """HF's `Gemma3nMultimodalEmbedder` for token ids (a multimodal checkpoint's image / audio
    ids, `[vocab_offset, vocab_offset + vocab_size)`): embedding, norm, projection to the text
    width, weightless norm. (Its `soft_embedding_norm`, for encoder outputs, is unused here.)"""

    def __init__(self, mm_config: Any, hidden: int):
        super().__init__()
        width, eps = int(mm_config.hidden_size), float(mm_config.rms_norm_eps)
        self.offset, self.size = int(mm_config.vocab_offset), int(mm_config.vocab_size)
        self.embedding = nn.Embedding(self.size, width)
        self.hard_embedding_norm = _gemma_norm(width, eps)
        self.embedding_projection = _replicated(width, hidden)
        self.embedding_post_projection_norm = WeightlessRMSNorm(eps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] (in range) -> [T, H]
        e = self.hard_embedding_norm(self.embedding(ids - self.offset))
        return self.embedding_post_projection_norm(self.embedding_projection(e))


class Gemma3nTextModel(DecoderStack):
    """Scaled embeddings (the multimodal checkpoint's image / audio token embedders with
    `mm_configs`), the AltUp streams and per-layer inputs, the decoder layers over their cache
    entries (a KV-sharing layer reads its producer's), the streams' merge and final norm (HF's
    `model.`)."""

    def __init__(self, config: Any, *, mm_configs: dict[str, Any] | None = None, tp: TPContext = SINGLE):
        super().__init__()
        if not int(getattr(config, "hidden_size_per_layer_input", 0) or 0):
            raise ValueError("Gemma 3n needs hidden_size_per_layer_input > 0")
        self.n_streams = int(config.altup_num_inputs)
        if self.n_streams < 1 or not 0 <= int(config.altup_active_idx) < self.n_streams:
            raise ValueError(f"altup_active_idx ({config.altup_active_idx}) outside altup_num_inputs "
                             f"({config.altup_num_inputs})")
        self.layer_types = gemma3_layer_types(config)
        self.modes = gemma4_kv_sharing(config, self.layer_types)
        n, hidden = len(self.layer_types), config.hidden_size
        kv_heads, head_dim = int(config.num_key_value_heads), int(config.head_dim)
        self.page, (plan,) = kv_page_plan([(tp.local_kv_heads(kv_heads), head_dim)])
        layers, self.cache_entries_of, specs, producer = [], [], [], {}
        for i, t in enumerate(self.layer_types):
            window = config.sliding_window if t == SLIDING else None
            reuse = self.modes[i] == "reuse"
            attn = Gemma4Attention(config, kv_heads, head_dim, window=window, k_eq_v=False, shared=reuse,
                                   page=self.page, plan=plan, tp=tp)
            layers.append(Gemma3nDecoderLayer(config, attn, i, tp=tp))
            if reuse:
                self.cache_entries_of.append(producer[t])
                continue
            self.cache_entries_of.append([len(specs)])
            specs.append(t)
            producer[t] = [len(specs) - 1]
        self.layers = nn.ModuleList(layers)
        self.entry_windows = [config.sliding_window if t == SLIDING else None for t in specs]
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, tp=tp)
        self.embed_scale = nn.Buffer(torch.tensor(hidden**0.5, dtype=torch.float32), persistent=False)
        self.norm = _gemma_norm(hidden, config.rms_norm_eps)
        self.rotary_emb = nn.ModuleDict({
            t: RotaryEmbedding(head_dim, gemma3_rope_parameters(config, t), config.max_position_embeddings)
            for t in sorted(set(self.layer_types))})
        init_per_layer_inputs(self, config, n, tp)
        self.altup_projections = nn.ModuleList(_replicated(hidden, hidden) for _ in range(1, self.n_streams))
        self.altup_unembed_projections = nn.ModuleList(
            _replicated(hidden, hidden) for _ in range(1, self.n_streams))
        self.mm_embedders = sorted(mm_configs or {})
        for name in self.mm_embedders:  # embed_vision, embed_audio
            setattr(self, name, Gemma3nMultimodalTokens(mm_configs[name], hidden))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        x = x * self.embed_scale.to(x.dtype)  # [T, H]; sqrt(hidden) rounded to the dtype, as HF
        for name in self.mm_embedders:  # (every row computed, as HF: no host sync)
            mm = getattr(self, name)
            hit = (input_ids >= mm.offset) & (input_ids < mm.offset + mm.size)  # [T]
            rows = mm(input_ids.clamp(mm.offset, mm.offset + mm.size - 1)).to(x.dtype)  # [T, H]
            x = torch.where(hit.unsqueeze(-1), rows, x)
        ropes = {t: rope(positions, x.dtype) for t, rope in self.rotary_emb.items()}
        ple = per_layer_inputs(self, input_ids, x, clamp_ids=True)  # [T, L, P]
        target = torch.mean(x**2, dim=-1, keepdim=True) ** 0.5  # [T, 1]
        streams = [x] + [_rescaled(proj(x), target) for proj in self.altup_projections]
        return torch.stack(streams), [(ropes[t], ple[:, i]) for i, t in enumerate(self.layer_types)]

    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def final(self, xs: torch.Tensor) -> torch.Tensor:  # [N, T, H] -> [T, H]
        target = torch.mean(xs[0] ** 2, dim=-1, keepdim=True) ** 0.5  # [T, 1]
        total = xs[0]
        for i, proj in enumerate(self.altup_unembed_projections, start=1):
            total = total + _rescaled(proj(xs[i]), target)
        return self.norm(total / self.n_streams)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        check_kv_caches(kv_caches, len(self.entry_windows))
        xs, extras = self.embed(input_ids, positions)  # [N, T, H]
        metas = meta.per_layer or [meta] * len(kv_caches)  # per cache entry (its column's)
        stored: dict[str, tuple] = {}  # the step's K/V of each type's producer (KV sharing)
        for layer, t, mode, extra, entries in zip(self.layers, self.layer_types, self.modes, extras,
                                                  self.cache_entries_of):
            xs, kv = layer(xs, *extra, [kv_caches[e] for e in entries], [metas[e] for e in entries],
                           stored.get(t) if mode == "reuse" else None)  # [N, T, H]
            if mode == "store":
                stored[t] = kv
        return self.final(xs)


class Gemma3nForCausalLM(PagedCausalLM):
    """Gemma 3n text LM on a paged KV cache (see `pagedserve.models.base.CausalLM` and the
    module docstring); `tp` makes it this rank's shard (not with activation sparsity)."""

    tied_by_default = True

    def __init__(self, config: Any, *, tp: TPContext = SINGLE, mm_configs: dict[str, Any] | None = None):
        super().__init__()
        self.model = Gemma3nTextModel(config, mm_configs=mm_configs, tp=tp)
        page = self.model.page
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=1, head_dim=page, tp=tp)
        specs = tuple(FullAttentionSpec(1, page) if w is None else SlidingWindowSpec(1, page, window=w)
                      for w in self.model.entry_windows)
        self.kv_cache_spec = KVCacheSpec(len(specs), 1, page, specs)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        # a KV-sharing layer's k/v projections and norms, which checkpoints may still hold
        self._unused = tuple(f"model.layers.{i}.self_attn.{m}."
                             for i, mode in enumerate(self.model.modes) if mode == "reuse"
                             for m in ("k_proj", "v_proj", "k_norm", "v_norm"))

    def backbone(self) -> nn.Module:
        return self.model

    def final_softcap(self) -> float | None:
        return self.final_logit_softcapping

    def _rename(self, name: str) -> str | None:
        name = super()._rename(name)
        if name is None or name.startswith(self._unused):
            return None
        if name.endswith(".embed_vision.soft_embedding_norm.weight") or \
                name.endswith(".embed_audio.soft_embedding_norm.weight"):
            return None  # (the encoders' soft tokens: not served)
        return name


class Gemma3nForConditionalGeneration(TextOfMultimodal, Gemma3nForCausalLM):
    """The text decoder of a multimodal Gemma 3n checkpoint (the vision and audio towers
    skipped; text-only inputs, the image / audio token ids embedded by their token embedders as
    HF does). HF's class applies the text config's final logit softcapping too."""

    _SKIP = TextOfMultimodal._SKIP + ("model.audio_tower.", "audio_tower.")

    def _text_kwargs(self, config: Any) -> dict:
        """The token embedders (`embed_vision`, `embed_audio`) of the sub-configs that have a
        `vocab_offset`."""
        mm = {}
        for name, key in (("embed_vision", "vision_config"), ("embed_audio", "audio_config")):
            sub = getattr(config, key, None)
            if sub is not None and getattr(sub, "vocab_offset", None) is not None:
                mm[name] = sub
        return {"mm_configs": mm}
