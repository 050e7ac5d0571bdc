"""What every model implementation offers to the model runner.

A model reads a flat batch: `input_ids [T]` and `positions [T]` for the T tokens scheduled this
step (all sequences concatenated), plus one `(k_cache, v_cache)` pair per attention layer and the
step's `AttentionMetadata`. It returns hidden states `[T, hidden]`; the runner picks the rows it
samples from and calls `compute_logits` on those only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.kv_spec import FullAttentionSpec, SlidingWindowSpec
from pagedserve.layers.attention import PagedAttention
from pagedserve.distributed.tp import TPContext
from pagedserve.layers.linear import ParallelLMHead
from pagedserve.layers.weights import load_named_weights

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache a model needs: `num_layers` layers of `num_kv_heads x head_dim` K and V per
    token, and what each layer keeps (`layers`: one `core.kv_spec` spec per layer --
    `FullAttentionSpec(num_kv_heads, head_dim)`, `SlidingWindowSpec(num_kv_heads, head_dim,
    window)`, `MLASpec(latent_dim)`, `sinks=True` on an attention spec; None: every layer full
    attention). Layers of one memory rule form a group with its own block table per sequence
    over one shared pool (`core.kv_spec.KVLayout`, worker/kv_cache.py)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layers: tuple | None = None
    # Pipeline stages (worker/pp_executor.py): the `[first, last)` model layers each stage's
    # worker holds the K / V of. The layout (groups, columns, block tables) stays the whole
    # model's; a worker allocates only its stage's layer slots, and a block's bytes are those
    # of the stage holding the most (`worker.kv_cache.held_slots`). None: one worker holds all.
    stages: tuple[tuple[int, int], ...] | None = None

    def layer_specs(self) -> tuple:
        """One spec per layer (`layers`, or full attention everywhere)."""
        if self.layers is not None:
            if len(self.layers) != self.num_layers:
                raise ValueError(f"KVCacheSpec: {len(self.layers)} layer specs for "
                                 f"{self.num_layers} layers")
            return tuple(self.layers)
        return (FullAttentionSpec(self.num_kv_heads, self.head_dim),) * self.num_layers


def attention_layer_specs(layers: Iterable[nn.Module], num_kv_heads: int,
                          head_dim: int) -> tuple | None:
    """Each decoder layer's KV spec from its `PagedAttention` (its sliding window, if any):
    None when a layer has not exactly one (the model then declares its specs itself)."""
    specs = []
    for layer in layers:
        attns = [m for m in layer.modules() if isinstance(m, PagedAttention)]
        if len(attns) != 1:
            return None
        window = attns[0].sliding_window
        specs.append(FullAttentionSpec(num_kv_heads, head_dim) if window is None
                     else SlidingWindowSpec(num_kv_heads, head_dim, window=window))
    return tuple(specs)


class CausalLM(Protocol):
    """The interface of `pagedserve.models.*ForCausalLM` classes.

    Constructors take `(config, *, tp=TPContext())`: with several tensor-parallel ranks the model
    is rank `tp.rank`'s shard, its `kv_cache_spec` counts that rank's KV heads, and
    `compute_logits` returns the logits on rank 0 only (`[S, 0]` on the others).
    """

    kv_cache_spec: KVCacheSpec

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab] fp32
        ...

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [S, hidden] -> [S] int64
        """`compute_logits(hidden).argmax(dim=-1)` computed without fp32 logits where the model
        can (greedy decoding), else None. NOTE: must return None on every tensor-parallel rank
        alike, or the ranks would disagree on calling `compute_logits` (a collective)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as in the HF checkpoint (safetensors names)."""
        ...


def head_kind(config: Any) -> str:
    """What the checkpoint has on top of its decoder stack: "lm" (an LM head: `*ForCausalLM`,
    `*LMHeadModel`, ...), "classifier" (`*ForSequenceClassification`: a `score` layer) or "none"
    (a bare base model saved by `AutoModel`: `LlamaModel`, `Qwen3Model`, ...)."""
    archs = list(getattr(config, "architectures", None) or [])
    if archs and all(a.endswith("ForSequenceClassification") for a in archs):
        return "classifier"
    if archs and all(a.endswith("Model") and not a.endswith("LMHeadModel") for a in archs):
        return "none"
    return "lm"


def check_kv_caches(kv_caches: list, num_layers: int) -> None:
    """ValueError unless there is one (k_cache, v_cache) pair per layer."""
    if len(kv_caches) != num_layers:
        raise ValueError(f"expected {num_layers} (k_cache, v_cache) pairs, one per layer, got {len(kv_caches)}")


def checkpoint_rename(name: str, *, prefix: str, tied: bool, own: tuple[str, ...] = ("lm_head.",)) -> str | None:
    """Map a checkpoint name onto our parameter names: None for rotary buffers and for a tied
    head's `lm_head.weight`; `prefix` added to names saved without it (bare base-model checkpoints)."""
    if name.endswith("inv_freq") or (tied and name == "lm_head.weight"):
        return None
    if not name.startswith((prefix, *own)):
        name = prefix + name
    return name


class DecoderStack(nn.Module):
    """Embeddings, decoder layers, final norm: the backbone of a `PagedCausalLM`. A subclass
    implements `embed`, `decoder_layers` and `final`; each layer is called as
    `layer(x, *extra, kv_cache, meta)` with that layer's `extra` inputs from `embed` (its RoPE
    tables, or nothing for absolute-position models)."""

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        """`([T, H] input of the first layer, one tuple of extra layer inputs per layer)`."""
        raise NotImplementedError

    def decoder_layers(self) -> nn.ModuleList:
        """The decoder layers, first to last."""
        raise NotImplementedError

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H']
        """What follows the last layer (final norm, output projection)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H']
        layers = self.decoder_layers()
        check_kv_caches(kv_caches, len(layers))
        x, extras = self.embed(input_ids, positions)  # [T, H]
        # NOTE: with several KV groups each layer reads its own column's metadata (block
        # tables and slots differ; `AttentionMetadata.per_layer`), else all read `meta`.
        metas = meta.per_layer or itertools.repeat(meta)
        for layer, extra, kv_cache, m in zip(layers, extras, kv_caches, metas):
            x = layer(x, *extra, kv_cache, m)  # [T, H]
        return self.final(x)


class CacheEntryStack(DecoderStack):
    """A decoder stack whose layers do not take one cache entry each (LFM2's convolutions, the
    recurrent layers' states: several entries a layer): `cache_entries_of[i]` lists layer i's
    entries and `layer_types[i]` its kind. A layer of a kind in `one_entry_kinds` (attention) is
    called as `layer(x, *extra, kv_cache, meta)`, any other with the lists of its entries and
    their metadata: `layer(x, *extra, [kv_cache, ...], [meta, ...])`."""

    one_entry_kinds: tuple[str, ...] = ()
    layer_types: list[str]
    cache_entries_of: list[list[int]]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H']
        check_kv_caches(kv_caches, self.cache_entries_of[-1][-1] + 1)
        x, extras = self.embed(input_ids, positions)  # [T, H]
        metas = meta.per_layer or [meta] * len(kv_caches)  # per cache entry (its column's)
        for layer, kind, extra, entries in zip(self.decoder_layers(), self.layer_types, extras,
                                               self.cache_entries_of):
            if kind in self.one_entry_kinds:
                x = layer(x, *extra, kv_caches[entries[0]], metas[entries[0]])  # [T, H]
            else:
                x = layer(x, *extra, [kv_caches[e] for e in entries], [metas[e] for e in entries])
        return self.final(x)


class PagedCausalLM(nn.Module):
    """What the `*ForCausalLM` classes share (they implement `CausalLM`): an LM head (tied to the
    input embedding when the config says so), the KV cache spec, logits, the fused greedy path
    and checkpoint loading. A subclass builds its decoder stack, then calls `_init_head`, and
    names in `backbone` the module whose forward maps `(input_ids, positions, kv_caches, meta)`
    to the hidden states the head reads.

    NOTE: `backbone` is a method, not an attribute: a submodule stored under a second name would
    appear twice among the parameters that checkpoint loading matches by name.
    """

    checkpoint_prefix = "model."  # added to bare base-model checkpoint names
    tied_by_default = True  # when the config has no `tie_word_embeddings`

    def bind_cache(self, block_size: int, cache_dtype: torch.dtype) -> None:
        """Fit what the model keeps in the KV cache to blocks of `block_size` tokens stored in
        `cache_dtype`, before its `kv_cache_spec` is read: a recurrent layer's state takes a
        number of cache entries that depends on both (`layers.recurrent_state`). Per-token K/V
        need nothing."""

    def _init_head(self, config: Any, embedding: nn.Module, *, head_in: int, num_kv_heads: int,
                   head_dim: int, tp: TPContext) -> None:
        self.config = config
        self.tied = bool(getattr(config, "tie_word_embeddings", self.tied_by_default))
        kind = head_kind(config)
        if kind != "lm":
            self.tied = True  # no LM head saved (the pooling runner reads no logits)
        # A sequence classifier's head over the last token's state (`*ForSequenceClassification`)
        self.score = nn.Linear(head_in, int(config.num_labels), bias=False) if kind == "classifier" \
            else None
        self.lm_head = ParallelLMHead(head_in, self.head_rows(config), tp=tp)
        if self.tied:
            self.lm_head.weight = embedding.weight
        kv_heads = tp.local_kv_heads(num_kv_heads)
        self.kv_cache_spec = KVCacheSpec(
            config.num_hidden_layers, kv_heads, head_dim,
            attention_layer_specs(self.backbone().decoder_layers(), kv_heads, head_dim))

    def head_rows(self, config: Any) -> int:
        """The LM head's rows: the vocabulary (Apertus 1.5's pruned head: fewer)."""
        return config.vocab_size

    def backbone(self) -> nn.Module:
        """The decoder stack (embeddings through the final norm / projection)."""
        raise NotImplementedError

    def forward(self, *step: Any) -> torch.Tensor:  # [T, H]
        """`(input_ids [T], positions [T], kv_caches, meta)` -> the backbone's hidden states."""
        return self.backbone()(*step)

    def final_softcap(self) -> float | None:
        """The cap of `cap * tanh(logits / cap)` applied to the logits, or None."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] fp32
        logits = self.lm_head(hidden).float()  # [S, V]
        cap = self.final_softcap()
        if cap is not None:
            logits = logits.div_(cap).tanh_().mul_(cap)  # in place: [S, V] fp32 is 1 MB a row
        return logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [S, H] -> [S] int64
        """`compute_logits(hidden).argmax(-1)` without the logits where the LM head can
        (`ParallelLMHead.greedy`); None otherwise. NOTE: not under a final softcap: tanh is
        monotonic, but in fp32 it maps distinct large logits to equal values, which moves ties."""
        if self.final_softcap() is not None:
            return None
        return self.lm_head.greedy(hidden)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, num_labels] fp32
        """The classifier head's logits (`*ForSequenceClassification` checkpoints only)."""
        if self.score is None:
            raise ValueError("the model has no classification head")
        return self.score(hidden.to(self.score.weight.dtype)).float()

    def _rename(self, name: str) -> str | None:
        """A checkpoint tensor name -> our parameter name, or None to skip it."""
        return checkpoint_rename(name, prefix=self.checkpoint_prefix, tied=self.tied,
                                 own=("lm_head.", "score."))

    def _transposed(self) -> Callable[[str], bool] | None:
        """Which parameters the checkpoint stores transposed (GPT-2's Conv1D), or None."""
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF checkpoint tensors, named as in the checkpoint (safetensors names)."""
        load_named_weights(self, weights, rename=self._rename, transposed=self._transposed())


class LMHeadBias:
    """An LM head with a bias (`lm_head.bias`: ERNIE 4.5 MoE's `use_bias`, Phi-3.5-MoE's
    `lm_head_bias`), added to the float32 logits on the rank that holds them (`[S, 0]` on the
    others). Mixed in before the LM class, whose `__init__` calls `init_lm_head_bias`."""

    lm_head_bias: nn.Parameter | None  # (set by init_lm_head_bias: a class default would block it)

    def init_lm_head_bias(self, vocab_size: int, enabled: bool) -> None:
        """`lm_head_bias` `[V]` when `enabled` (loaded from `lm_head.bias`), else None."""
        self.lm_head_bias = nn.Parameter(torch.zeros(vocab_size)) if enabled else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] fp32
        logits = super().compute_logits(hidden)  # [S, V] (rank 0; [S, 0] on the other ranks)
        if self.lm_head_bias is None or logits.shape[-1] == 0:
            return logits
        return logits.add_(self.lm_head_bias.float())

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [S, H] -> [S] int64
        """As `PagedCausalLM.greedy_tokens`, except with an LM head bias: the logits then."""
        return super().greedy_tokens(hidden) if self.lm_head_bias is None else None

    def _rename(self, name: str) -> str | tuple | None:
        return "lm_head_bias" if name == "lm_head.bias" else super()._rename(name)


class RenamedCheckpoint:
    """Checkpoint names mapped onto the model's before loading: each `(old, new)` of
    `checkpoint_renames` replaces a part of the name (a family whose modules take Llama's
    names where its checkpoint says `dense`, `fc1`, `final_layernorm`: Phi-2, GPT-NeoX, ...).
    Mixed in before the LM class."""

    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def _rename(self, name: str) -> str | tuple | None:
        for old, new in self.checkpoint_renames:
            name = name.replace(old, new)
        return super()._rename(name)
