"""LoRA on top of the base projections, batched over adapters (Punica's SGMV idea).

Every adapted projection (q/k/v/o, gate/up/down of each decoder layer) gets a forward hook that
adds the adapters' low-rank products to the base product, whatever the base weight's format
(bf16, float32, int8 or GGUF blocks: the base product is untouched, weights are never merged).
The slot table keeps each projection's adapters stacked: A as [slots, r_max * in] and B as
[slots, r_max * out], a slot's first r * in (r * out) values being its A [r, in] (B [out, r],
scaled) so that each is one contiguous view.

Per step, `StepMapping` orders the tokens that carry an adapter by slot (one index tensor, the
segments of equal slot in it); a hook gathers those tokens' inputs once, runs each segment's
shrink (x A^T, [n, r]) and expand (h B^T, [n, out]) and adds the results back with one
index_add. Base tokens (slot -1) are left as the base product computed them. A batch whose
tokens all carry one adapter skips the gather.

NOTE: every product goes through `layers.linear.linear`, so in float32 a token's result does not
depend on the batch (the batch-invariant kernel), nor on its slot: shapes depend only on the
adapter's own rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.layers.linear import linear
from pagedserve.lora.adapter import TARGET_MODULES


@dataclass
class StepMapping:
    """This step's tokens by adapter slot: `single` (every token in that one slot: no gather),
    else `perm` (the flat-batch indices of the adapter tokens, ordered by slot) and `segments`
    ((slot, start, length) runs of `perm`)."""

    single: int | None
    perm: torch.Tensor | None
    segments: list[tuple[int, int, int]]

    @classmethod
    def build(cls, row_slots: list[int], row_tokens: list[int],
              device: torch.device) -> StepMapping | None:
        """The mapping for rows of `row_tokens` tokens each in slots `row_slots` (-1: the base
        model); None when no row carries an adapter."""
        distinct = set(row_slots)
        if distinct == {-1}:
            return None
        if len(distinct) == 1:
            return cls(row_slots[0], None, [])
        by_slot: dict[int, list[int]] = {}
        offset = 0
        for slot, n in zip(row_slots, row_tokens):
            if slot >= 0:
                by_slot.setdefault(slot, []).extend(range(offset, offset + n))
            offset += n
        perm: list[int] = []
        segments = []
        for slot in sorted(by_slot):
            segments.append((slot, len(perm), len(by_slot[slot])))
            perm.extend(by_slot[slot])
        return cls(None, torch.tensor(perm, dtype=torch.long, device=device), segments)


class LoRAStacks:
    """The slot table's tensors, per adapted projection (layer, module), created when a loaded
    adapter first targets that projection; and the step's `mapping` (None: no adapter this step,
    the hooks and the fused decode layer do nothing different)."""

    def __init__(self, num_slots: int, max_rank: int, dims: dict[str, tuple[int, int]],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots, self.max_rank, self.dims = num_slots, max_rank, dims
        self.dtype, self.device = dtype, device
        self.a: dict[tuple[int, str], torch.Tensor] = {}  # [slots, r_max * in]
        self.b: dict[tuple[int, str], torch.Tensor] = {}  # [slots, r_max * out]
        self.rank: dict[tuple[int, str], dict[int, int]] = {}  # slot -> rank, where present
        self.mapping: StepMapping | None = None

    def put(self, slot: int, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor) -> None:
        """Write one projection's A [r, in] / B [out, r] into `slot`."""
        d_in, d_out = self.dims[key[1]]
        if key not in self.a:
            self.a[key] = torch.zeros(self.num_slots, self.max_rank * d_in, dtype=self.dtype,
                                      device=self.device)
            self.b[key] = torch.zeros(self.num_slots, self.max_rank * d_out, dtype=self.dtype,
                                      device=self.device)
            self.rank[key] = {}
        r = a.shape[0]
        self.a[key][slot, : r * d_in].copy_(a.reshape(-1))
        self.b[key][slot, : r * d_out].copy_(b.reshape(-1))
        self.rank[key][slot] = r

    def clear(self, slot: int) -> None:
        """Forget what `slot` held (its projections no longer adapted)."""
        for ranks in self.rank.values():
            ranks.pop(slot, None)

    def delta_views(self, key: tuple[int, str], slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`slot`'s A [r, in] and B [out, r] for projection `key` (contiguous views)."""
        r = self.rank[key][slot]
        d_in, d_out = self.dims[key[1]]
        return (self.a[key][slot, : r * d_in].view(r, d_in),
                self.b[key][slot, : r * d_out].view(d_out, r))

    def apply(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base product of `x` [T, in], [T, out]) plus each adapter token's
        x A^T B^T, in place."""
        m, ranks = self.mapping, self.rank.get(key)
        if m is None or not ranks:
            return y
        if m.single is not None:
            if m.single in ranks:
                a, b = self.delta_views(key, m.single)
                y.add_(linear(linear(x, a), b))
            return y
        segments = [s for s in m.segments if s[0] in ranks]
        if not segments:
            return y
        xs = x.index_select(0, m.perm)  # [Ta, in], by slot
        parts = []
        for slot, start, n in segments:
            a, b = self.delta_views(key, slot)
            parts.append(linear(linear(xs[start:start + n], a), b))  # [n, out]
        if len(segments) == len(m.segments):
            index = m.perm
        else:
            index = torch.cat([m.perm[start:start + n] for _, start, n in segments])
        y.index_add_(0, index, torch.cat(parts) if len(parts) > 1 else parts[0])
        return y


def _projections(layer) -> dict[str, torch.nn.Module]:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    found = {}
    for name in TARGET_MODULES:
        owner = attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else mlp
        module = getattr(owner, name, None) if owner is not None else None
        if module is not None:
            found[name] = module
    return found


def install_hooks(model: torch.nn.Module, stacks: LoRAStacks) -> int:
    """Hook every adaptable projection of `model`'s decoder layers; mark each layer
    (`lora_stacks`: the fused CPU decode layer steps aside while a step carries adapters).
    ValueError for a model without Llama-style projections. Returns the number of hooks."""
    layers = model.backbone().decoder_layers()
    count = 0
    for i, layer in enumerate(layers):
        found = _projections(layer)
        if set(found) != set(TARGET_MODULES):
            raise ValueError(
                f"enable_lora: {type(model).__name__} has no Llama-style q/k/v/o and gate/up/"
                "down projections; LoRA serves the Llama-family models (Llama, Mistral, Qwen2, "
                "Qwen3, Gemma 3)")
        for name, module in found.items():
            if getattr(module, "tp", None) is not None and module.tp.is_parallel:
                raise ValueError("enable_lora: tensor-parallel LoRA is not supported")
            module.register_forward_hook(_hook(stacks, (i, name)))
            count += 1
        layer.lora_stacks = stacks
    return count


def _hook(stacks: LoRAStacks, key: tuple[int, str]):
    def hook(module, args, out):
        if stacks.mapping is None:
            return None
        return stacks.apply(key, args[0], out)

    return hook
