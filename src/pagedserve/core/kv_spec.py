"""What each layer keeps in the KV cache, and how layers share one pool of blocks. Pure Python.

A model declares one spec per layer (`models.base.KVCacheSpec.layers`):

- `FullAttentionSpec(num_kv_heads, head_dim)`: a K and a V per head for every token, all kept;
- `SlidingWindowSpec(num_kv_heads, head_dim, window)`: the same per token, but a query reads only
  the last `window` keys (its own included), so a block no query of the sequence can reach again
  goes back to the pool;
- `MLASpec(latent_dim)`: latent attention (DeepSeek V2/V3): one compressed vector per token
  (the latent and the rope key side by side), no V tensor;
- `RecurrentStateSpec(num_kv_heads, head_dim)`: a cache entry of a recurrent layer's state
  (Gated DeltaNet, Mamba: `layers.recurrent_state`): a fixed-size state per sequence, rewritten
  in place every step; its group holds one block per sequence (its first logical block) for the
  sequence's life, whatever its length, and none in later logical blocks (null entries); with
  `num_tensors=1`, in an MLA model's page shape `(1, 1, head_dim)`. Such
  state cannot be rolled back or shared by prefix: models with it run without prefix caching
  and speculative decoding;
- `sinks=True` on an attention spec: learned per-head sink logits (gpt-oss). They change no
  memory rule (the sink is a parameter, not a cached token): such layers group with the others
  of their window; the layer passes its sinks to the attention call itself.

Layers of one memory rule form a *group*; `KVLayout.from_specs` maps groups onto one pool of
equal-size blocks. A pool block holds `block_size` tokens of `slots` layers (one page in each
of `slots` tensors per K / V); a group of `n` layers takes `lanes = ceil(n / slots)` pool blocks
per logical block of a sequence, one per *column*. A sequence's block table is one flat list:
logical block `i` of column `c` is `table[i * width + c]` (`width` = the columns of all
groups), so a model with one group has today's table (`width == 1`). Model layer `l` reads its
K / V from slot tensor `layer_slot[l]` through column `layer_column[l]`.

NOTE: memory moves freely between groups because every pool block has the same size: the
groups must agree on the page shape (KV heads, head size, tensors per layer). Models whose
layers differ there are refused (ValueError) unless `hybrid=False` makes them one group.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttentionSpec:
    """Attention over every previous token: a K and a V of `num_kv_heads x head_dim` per token.
    `sinks`: the layer adds learned per-head sink logits (no memory rule of their own)."""

    num_kv_heads: int
    head_dim: int
    sinks: bool = False

    window = None  # every block is kept for the sequence's life
    num_tensors = 2  # K and V

    def page_shape(self) -> tuple[int, int, int]:
        """(tensors, heads, head size) of one token of one layer: layers sharing pool blocks
        must agree on it."""
        return (self.num_tensors, self.num_kv_heads, self.head_dim)

    def bytes_per_token(self, dtype_bytes: int) -> int:
        """KV bytes one token takes in one layer of this spec."""
        return self.num_tensors * self.num_kv_heads * self.head_dim * dtype_bytes

    def rule(self) -> tuple:
        """What decides which blocks a sequence keeps: layers with equal rules form a group."""
        return ("full",)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Attention over the last `window` tokens (the query's own included): a block whose last
    token is `window` or more positions before the next query is never read again."""

    window: int = 0  # (a default only for the dataclass field order: always given)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"sliding window must be >= 1, got {self.window}")

    def rule(self) -> tuple:
        return ("sliding", self.window)


@dataclass(frozen=True)
class RecurrentStateSpec(FullAttentionSpec):
    """A cache entry holding part of a recurrent layer's state (attention's page shape, the
    pool's blocks being of one size): one block per sequence, its first logical block, kept for
    the sequence's life and written in place every step. `num_tensors=1` takes latent
    attention's page shape `(1, 1, head_dim)` (`MLASpec(head_dim)`: Kimi Linear's delta
    attention beside MLA layers)."""

    num_tensors: int = 2

    def rule(self) -> tuple:
        return ("state",)


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek V2/V3): one vector of `latent_dim` values per
    token (kv_lora_rank + qk_rope_head_dim: the compressed KV and the shared rope key), stored
    in one tensor (no V)."""

    latent_dim: int

    window = None
    num_tensors = 1
    sinks = False

    def page_shape(self) -> tuple[int, int, int]:
        return (1, 1, self.latent_dim)

    def bytes_per_token(self, dtype_bytes: int) -> int:
        return self.latent_dim * dtype_bytes

    def rule(self) -> tuple:
        return ("mla",)


LayerSpec = FullAttentionSpec | MLASpec


@dataclass(frozen=True)
class KVGroup:
    """Layers of one memory rule: their spec (of the first), model layer indices, the pool
    blocks each logical block takes (`lanes`) and its first column in a table row."""

    spec: LayerSpec
    layers: tuple[int, ...]
    lanes: int
    first_column: int

    @property
    def window(self) -> int | None:
        return self.spec.window

    @property
    def columns(self) -> range:
        return range(self.first_column, self.first_column + self.lanes)

    @property
    def name(self) -> str:
        rule = self.spec.rule()
        return rule[0] if len(rule) == 1 else f"{rule[0]}-{rule[1]}"


# A layout may leave at most this share of the layer slots of its pool blocks unused (a group
# whose layer count is not a multiple of `slots`), else fewer layers per block are taken.
_MAX_PADDING = 0.1


@dataclass(frozen=True)
class KVLayout:
    """How a model's layers sit in the pool's blocks; see the module docstring."""

    groups: tuple[KVGroup, ...]
    slots: int  # layers per pool block (tensors per K / V)
    layer_slot: tuple[int, ...]  # per model layer: its slot tensor
    layer_column: tuple[int, ...]  # per model layer: its column of the table row

    @property
    def width(self) -> int:
        """Pool blocks per logical block (the columns of a table row)."""
        return sum(g.lanes for g in self.groups)

    @property
    def num_layers(self) -> int:
        return len(self.layer_slot)

    @property
    def page_spec(self) -> LayerSpec:
        return self.groups[0].spec

    def column_windows(self) -> tuple[int | None, ...]:
        """The window of each column (None: full)."""
        out: list[int | None] = []
        for g in self.groups:
            out.extend([g.window] * g.lanes)
        return tuple(out)

    def state_columns(self) -> tuple[int, ...]:
        """The columns of recurrent state groups (a block in the first logical block only)."""
        return tuple(c for g in self.groups if g.spec.rule() == ("state",) for c in g.columns)

    def bytes_per_block(self, block_size: int, dtype_bytes: int) -> int:
        """Bytes of one pool block: `block_size` tokens of `slots` layers."""
        return self.slots * block_size * self.page_spec.bytes_per_token(dtype_bytes)

    def blocks_per_request(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Pool blocks one sequence of `num_tokens` holds at its peak, computing at most `chunk`
        tokens a step: every block of a full group; of a sliding group the blocks of the window
        before a chunk and of the chunk (vLLM's rule, `SlidingWindowSpec.max_memory_usage`)."""
        full = -(-num_tokens // block_size)
        need = 0
        for g in self.groups:
            if g.spec.rule() == ("state",):
                need += g.lanes  # (one logical block, whatever the length)
            elif g.window is None:
                need += g.lanes * full
            else:
                span = min(g.window - 1 + chunk, num_tokens)
                need += g.lanes * min(full, -(-span // block_size) + 1)
        return need

    def describe(self) -> str:
        """One line: the groups, their layers and lanes."""
        parts = [f"{g.name} x{len(g.layers)} layers ({g.lanes} lane{'s' * (g.lanes > 1)})"
                 for g in self.groups]
        return f"{', '.join(parts)}; {self.slots} layer(s) per block"

    @classmethod
    def uniform(cls, num_layers: int, spec: LayerSpec) -> "KVLayout":
        """Every layer in one group (today's cache): one lane of all layers."""
        return cls((KVGroup(spec, tuple(range(num_layers)), 1, 0),), num_layers,
                   tuple(range(num_layers)), (0,) * num_layers)

    @classmethod
    def from_specs(cls, specs: "list[LayerSpec] | tuple[LayerSpec, ...]",
                   hybrid: bool = True) -> "KVLayout":
        """The layout of layers with these specs. `hybrid=False`: one group of full attention
        (every block kept; what the cache did before groups, `disable_hybrid_kv_cache_manager`).

        The layers per block (`slots`) is the largest count with the fewest columns that leaves
        at most 10% of the pool's layer slots unused: Gemma 3 270M (15 sliding, 3 full layers)
        takes 3 layers per block, 5 sliding lanes and 1 full lane."""
        specs = list(specs)
        if not specs:
            raise ValueError("a model needs at least one layer's KV cache spec")
        shapes = {s.page_shape() for s in specs}
        by_rule: dict[tuple, list[int]] = {}
        for i, s in enumerate(specs):
            by_rule.setdefault(s.rule() if hybrid else ("full",), []).append(i)
        if len(shapes) > 1:
            raise ValueError(f"layers with different KV page shapes {sorted(shapes)} cannot "
                             "share one pool of blocks")
        first = specs[0]
        if not hybrid or len(by_rule) == 1:
            spec = first if hybrid else _as_full(first)
            return cls.uniform(len(specs), spec)
        counts = [len(v) for v in by_rule.values()]
        total = len(specs)
        best = (total + 1, 1)  # (columns, -slots)
        for u in range(1, min(counts) + 1):
            lanes = sum(-(-n // u) for n in counts)
            padding = lanes * u - total
            if padding <= _MAX_PADDING * total and (lanes, -u) < best:
                best = (lanes, -u)
        slots = -best[1]
        groups, slot_of, col_of = [], [0] * total, [0] * total
        column = 0
        for layers in by_rule.values():
            lanes = -(-len(layers) // slots)
            groups.append(KVGroup(specs[layers[0]], tuple(layers), lanes, column))
            for k, layer in enumerate(layers):
                col_of[layer] = column + k // slots
                slot_of[layer] = k % slots
            column += lanes
        return cls(tuple(groups), slots, tuple(slot_of), tuple(col_of))


def _as_full(spec: LayerSpec) -> LayerSpec:
    """The spec with every block kept (a sliding layer's window dropped from the memory rule; a
    recurrent state's entries then hold a block in every logical block, the first one read)."""
    if isinstance(spec, RecurrentStateSpec) and spec.num_tensors == 1:  # (beside MLA layers)
        return MLASpec(spec.head_dim)
    if isinstance(spec, FullAttentionSpec) and type(spec) is not FullAttentionSpec:
        return FullAttentionSpec(spec.num_kv_heads, spec.head_dim, spec.sinks)
    return spec
