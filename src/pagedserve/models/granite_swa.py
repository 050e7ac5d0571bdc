"""Granite SWA (`GraniteSWAForCausalLM`) and Granite MoE SWA (`GraniteMoeSWAForCausalLM`): Granite
(`models.granite`) and Granite MoE Shared (`models.granite_moe`) with sliding-window layers,
learned attention sinks and a RoPE base per layer.

Differences from Granite / Granite MoE Shared, as in HF 5.x:
- `layer_types` puts a window of `sliding_window` on the "sliding_attention" layers (HF's
  default: every fourth layer full, from the first);
- every attention adds a learned sink logit per query head to its softmax's denominator
  (`self_attn.sinks` `[Hq]`; HF scales the output by sigmoid(lse - sink), the same softmax);
- `layer_rope_theta[i]` is layer i's RoPE base, 0 meaning no RoPE (NoPE: the identity rotation,
  as SmolLM3's, `models.smollm3`).
The Granite multipliers (embedding, residual, attention scale, logits) are Granite's.
NOTE: layers with sinks run their modules (the fused decode layer takes none).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.rotary import RotaryEmbedding, norm_and_rotate, rope_parameters
from pagedserve.layers.linear import ShardSpec, set_shard
from pagedserve.layers.weights import read_full
from pagedserve.models.base import KVCache
from pagedserve.models.granite import GraniteDecoderLayer, GraniteForCausalLM, GraniteModel
from pagedserve.models.granite_moe import GraniteMoeModel, GraniteMoeSharedForCausalLM
from pagedserve.models.llama import LlamaAttention, head_dim_of
from pagedserve.models.smollm3 import identity_rope_for


class SinkAttention(LlamaAttention):
    """Llama attention with a learned sink logit per query head (`sinks` `[Hq]`, this rank's
    heads) given to the attention call (as gpt-oss's, without its biases)."""

    def __init__(self, config: Any, sliding_window: int | None, *, tp: TPContext = SINGLE):
        head_dim = head_dim_of(config)
        super().__init__(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
                         scale=float(config.attention_multiplier), sliding_window=sliding_window,
                         qkv_bias=bool(getattr(config, "attention_bias", False)),
                         o_bias=bool(getattr(config, "attention_bias", False)), tp=tp)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        if tp.is_parallel:
            start = tp.rank * self.num_heads
            set_shard(self.sinks, ShardSpec(0, ((start, start + self.num_heads),), config.num_attention_heads))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata, q_scale: torch.Tensor | None = None) -> torch.Tensor:  # [T, H]
        q, k, v = self.qkv_heads(x)  # [T, Hq, D], [T, Hkv, D] x 2
        q, k = norm_and_rotate(q, k, *rope, None, None, self.ops)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, sinks=self.sinks))  # [T, H]


def layer_rope_thetas(config: Any) -> list[float]:
    """Each layer's RoPE base (`layer_rope_theta`, 0 = NoPE; HF's default: the global one)."""
    thetas = getattr(config, "layer_rope_theta", None)
    if thetas is None:
        thetas = [rope_parameters(config)["rope_theta"]] * config.num_hidden_layers
    if len(thetas) != config.num_hidden_layers:
        raise ValueError(f"config.layer_rope_theta has {len(thetas)} entries for {config.num_hidden_layers} layers")
    return [float(t) for t in thetas]


class PerLayerRope:
    """A RoPE table per distinct nonzero `layer_rope_theta`, each layer given its own; NoPE
    layers (theta 0) the identity rotation. Mixed in before the stack class."""

    def make_rotary_emb(self, config: Any) -> nn.Module:
        self.thetas = layer_rope_thetas(config)
        params = rope_parameters(config)
        return nn.ModuleDict({
            str(i): RotaryEmbedding(head_dim_of(config), {**params, "rope_theta": t}, config.max_position_embeddings)
            for i, t in enumerate(sorted({t for t in self.thetas if t}))})

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids) * self.embedding_multiplier  # [T, H]
        distinct = sorted({t for t in self.thetas if t})
        tables = {t: self.rotary_emb[str(i)](positions, x.dtype) for i, t in enumerate(distinct)}  # 2 x [T, D]
        if not tables:  # every layer NoPE: identity tables of the head width
            d = self.layers[0].self_attn.head_dim
            one = torch.ones(positions.shape[0], d, dtype=x.dtype, device=x.device)  # [T, D]
            return x, [((one, torch.zeros_like(one)),)] * len(self.layers)
        first = next(iter(tables.values()))
        extras = [(tables[t],) if t else (first,) for t in self.thetas]
        return x, identity_rope_for(extras, [bool(t) for t in self.thetas])


class GraniteSWADecoderLayer(GraniteDecoderLayer):
    """Granite's block with the sink attention (its window from `layer_types`)."""

    def __init__(self, config: Any, sliding_window: int | None, *, tp: TPContext = SINGLE, **kwargs):
        super().__init__(config, sliding_window, tp=tp, **kwargs)
        self.self_attn = SinkAttention(config, sliding_window, tp=tp)


class GraniteSWAModel(PerLayerRope, GraniteModel):
    """Granite's stack with sink-attention layers and a RoPE base per layer."""

    layer_class = GraniteSWADecoderLayer


def with_sinks(spec):
    """`spec` (a model's KV cache spec) with `sinks=True` on every layer (no memory rule: the
    sliding layers form one group and the full ones another, as without sinks)."""
    return dataclasses.replace(spec, layers=tuple(dataclasses.replace(s, sinks=True) for s in spec.layer_specs()))


class GraniteSWAForCausalLM(GraniteForCausalLM):
    """Granite SWA decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = GraniteSWAModel
    tied_by_default = True

    def __init__(self, config: Any, **kwargs):
        super().__init__(config, **kwargs)
        self.kv_cache_spec = with_sinks(self.kv_cache_spec)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF Granite SWA checkpoint tensors (or a GGUF file's, `models.gguf_granite_swa`)."""
        super().load_weights(_sink_names(weights))


class GraniteMoeSWAModel(PerLayerRope, GraniteMoeModel):
    """Granite MoE's stack with a RoPE base per layer (the sink attention from `make_attention`)."""


class GraniteMoeSWAForCausalLM(GraniteMoeSharedForCausalLM):
    """Granite MoE SWA decoder-only LM on a paged KV cache (see the module docstring): Granite MoE
    (Shared when `shared_intermediate_size` > 0) with the sink attention and `layer_types`."""

    model_class = GraniteMoeSWAModel
    tied_by_default = True

    def __init__(self, config: Any, **kwargs):
        super().__init__(config, **kwargs)
        self.kv_cache_spec = with_sinks(self.kv_cache_spec)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        from pagedserve.models.llama import layer_sliding_windows

        return layer_sliding_windows(config)

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module] | None:
        windows = self.sliding_windows(config)
        return lambda i: SinkAttention(config, windows[i], tp=tp)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF Granite MoE SWA checkpoint tensors: the experts as `experts.gate_up_proj` `[E, 2I, H]`
        (gate rows, then up rows) / `experts.down_proj` `[E, H, I]` and the router as
        `router.weight` (transformers 5's layout), or Granite MoE's `input_linear` /
        `output_linear` / `router.layer`, split as Granite MoE's."""
        super().load_weights(_granite_moe_names(weights))


_SWA_MOE_NAMES = {".block_sparse_moe.experts.down_proj": ".block_sparse_moe.output_linear.weight",
                  ".block_sparse_moe.router.weight": ".block_sparse_moe.router.layer.weight"}


def _sink_names(pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The GGUF reader's `self_attn.sinks.weight` (llama.cpp's `attn_sinks.weight`) as HF's
    `self_attn.sinks`."""
    for name, source in pairs:
        yield (name[: -len(".weight")] if name.endswith(".self_attn.sinks.weight") else name), source


def _granite_moe_names(pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Transformers 5's Granite MoE SWA tensor names as Granite MoE's (`models.granite_moe`), the
    fused `experts.gate_up_proj` `[E, 2I, H]` split into the gate / up stacks here (a GGUF file's
    quantized rows of blocks kept)."""
    for name, source in _sink_names(pairs):
        name = name.removesuffix(".weight") if ".block_sparse_moe.experts." in name else name
        if name.endswith(".block_sparse_moe.experts.gate_up_proj"):
            stem = name[: -len("gate_up_proj")]
            gate, up = _split_gate_up(source)
            yield f"{stem}gate_proj.weight", gate
            yield f"{stem}up_proj.weight", up
            continue
        for old, new in _SWA_MOE_NAMES.items():
            if name.endswith(old):
                name = name[: -len(old)] + new
                break
        yield name, source


def _split_gate_up(source: Any) -> tuple[Any, Any]:
    """`[E, 2I, H]` (values, or a `QuantizedTensor`'s rows of blocks) -> its `[E, I, H]` gate and
    up halves."""
    from pagedserve.layers.quantization import QuantizedTensor

    if isinstance(source, QuantizedTensor):
        e, rows, cols = source.shape
        return tuple(QuantizedTensor(part.contiguous(), source.format, (e, rows // 2, cols), source.ggml_type)
                     for part in (source.data[:, : rows // 2], source.data[:, rows // 2:]))
    t = read_full(source)  # [E, 2I, H]
    if t.dim() != 3 or t.shape[1] % 2:
        raise ValueError(f"experts.gate_up_proj: expected [experts, 2 * inter, hidden], got {tuple(t.shape)}")
    inter = t.shape[1] // 2
    return t[:, :inter], t[:, inter:]
