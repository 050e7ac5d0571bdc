"""LoRA on top of the base projections, batched over adapters (Punica's BGMV idea).

Every adapted projection (q/k/v/o, gate/up/down of each decoder layer) gets a forward hook that
adds the adapters' low-rank products to the base product, whatever the base weight's format
(bf16, float32, int8 or GGUF blocks: the base product is untouched, weights are never merged).
The slot table keeps each projection's adapters stacked: A as [slots * r_max, in] (slot s in
rows s * r_max ..) and B as [out, slots * r_max] (slot s in those columns), zero beyond each
adapter's rank.

Per step, `StepMapping` holds each token's slot as a one-hot mask [T, slots, 1] (all zero for a
base token). A hook then runs one gathered shrink, `h = x A_all^T` [T, slots * r_max] (one for
q/k/v together and one for gate/up, which read the same input), masks each token's row to its
own slot's block, and one expand, `y += h B_all^T`: every token gets its own adapter's
x A^T B^T, base tokens exactly zero (per layer 4 shrinks and 7 expands, whatever the number of
adapters in the batch).

NOTE: every product goes through `layers.linear.linear`, whose per-row results do not depend on
the batch; the other slots' blocks of a token's row are exact zeros, so a token's result does not
depend on its slot, on the other adapters, nor on the table's size either (checked in
tests/lora/test_lora_layers.py for the kernels this machine runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.layers.linear import linear
from pagedserve.lora.adapter import TARGET_MODULES


@dataclass
class StepMapping:
    """This step's tokens by adapter slot: `mask` [T, slots, 1] (one-hot, in the model dtype;
    zero rows for base tokens) and `slots` (the slots in use)."""

    mask: torch.Tensor
    slots: frozenset[int]

    @classmethod
    def build(cls, row_slots: list[int], row_tokens: list[int], num_slots: int,
              dtype: torch.dtype, device: torch.device) -> StepMapping | None:
        """The mapping for rows of `row_tokens` tokens each in slots `row_slots` (-1: the base
        model); None when no row carries an adapter."""
        used = frozenset(s for s in row_slots if s >= 0)
        if not used:
            return None
        per_token = torch.repeat_interleave(torch.tensor(row_slots, dtype=torch.long),
                                            torch.tensor(row_tokens, dtype=torch.long))  # [T]
        mask = per_token.unsqueeze(1) == torch.arange(num_slots).unsqueeze(0)  # [T, slots]
        return cls(mask.to(dtype).unsqueeze(-1).to(device), used)


# The projections that read the same input share one shrink: (group, member index).
GROUPS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
          "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
GROUP_SIZES = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}


class LoRAStacks:
    """The slot table's tensors, per layer and input group (q/k/v, o, gate/up, down: the
    projections of one input share their A stack and its shrink) and per projection (B), created
    when a loaded adapter first targets them; and the step's `mapping` (None: no adapter this
    step, the hooks and the fused decode layer do nothing different)."""

    def __init__(self, num_slots: int, max_rank: int, dims: dict[str, tuple[int, int]],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_slots, self.max_rank, self.dims = num_slots, max_rank, dims
        self.width = num_slots * max_rank  # one projection's columns of a shrink
        self.dtype, self.device = dtype, device
        self.a: dict[tuple[int, str], torch.Tensor] = {}  # (layer, group): [members * width, in]
        self.b: dict[tuple[int, str], torch.Tensor] = {}  # (layer, module): [out, width]
        self.present: dict[tuple[int, str], set[int]] = {}  # slots adapting the projection
        self.mapping: StepMapping | None = None
        # the last shrink: ((layer, group), its input, h [T, members, slots, r_max])
        self._shrunk: tuple | None = None

    def set_mapping(self, mapping: StepMapping | None) -> None:
        self.mapping, self._shrunk = mapping, None

    def put(self, slot: int, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor) -> None:
        """Write one projection's A [r, in] / B [out, r] into `slot`."""
        layer, module = key
        d_in, d_out = self.dims[module]
        group, member = GROUPS[module]
        gkey = (layer, group)
        if gkey not in self.a:
            self.a[gkey] = torch.zeros(GROUP_SIZES[group] * self.width, d_in, dtype=self.dtype,
                                       device=self.device)
        if key not in self.b:
            self.b[key] = torch.zeros(d_out, self.width, dtype=self.dtype, device=self.device)
            self.present[key] = set()
        lo, r = slot * self.max_rank, a.shape[0]
        rows = self.a[gkey][member * self.width + lo:]
        rows[: self.max_rank].zero_()
        rows[:r].copy_(a)
        self.b[key][:, lo:lo + self.max_rank].zero_()
        self.b[key][:, lo:lo + r].copy_(b)
        self.present[key].add(slot)
        self._shrunk = None

    def clear(self, slot: int) -> None:
        """Forget what `slot` held (its projections no longer adapted; their blocks zeroed)."""
        lo, hi = slot * self.max_rank, (slot + 1) * self.max_rank
        for (layer, module), slots in self.present.items():
            if slot in slots:
                slots.discard(slot)
                group, member = GROUPS[module]
                off = member * self.width
                self.a[(layer, group)][off + lo:off + hi].zero_()
                self.b[(layer, module)][:, lo:hi].zero_()
        self._shrunk = None

    def _shrink(self, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
        """x A_group^T masked to each token's slot: [T, members, slots, r_max] (computed once for
        the projections that share `x`)."""
        gkey = (layer, group)
        last = self._shrunk
        if last is not None and last[0] == gkey and last[1] is x:
            return last[2]
        t = x.shape[0]
        h = linear(x, self.a[gkey]).view(t, GROUP_SIZES[group], self.num_slots, self.max_rank)
        h.mul_(self.mapping.mask.unsqueeze(1))  # each token's own slot only (base tokens: 0)
        self._shrunk = (gkey, x, h)  # NOTE: holds x, so its identity cannot be reused
        return h

    def apply(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base product of `x` [T, in], [T, out]) plus each adapter token's
        x A^T B^T, in place."""
        m, present = self.mapping, self.present.get(key)
        if m is None or not present or present.isdisjoint(m.slots):
            return y
        layer, module = key
        group, member = GROUPS[module]
        h = self._shrink(layer, group, x)[:, member].reshape(x.shape[0], self.width)
        return y.add_(linear(h, self.b[key]))  # expand


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
