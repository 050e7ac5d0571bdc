"""LoRA on top of the base projections, batched over adapters (Punica's BGMV / SGMV ideas).

Every adapted projection (q/k/v/o or latent attention's q_a / q_b / kv_a, gate/up/down of each
decoder layer: `lora.adapter.projections`) gets a forward hook that
adds the adapters' low-rank products to the base product, whatever the base weight's format
(bf16, float32, int8 or GGUF blocks: the base product is untouched, weights are never merged).
The slot table keeps each projection's adapters stacked (`LoRAStacks`: A [slots, r_max, in],
B [out, slots, r_max], zero beyond each adapter's rank).

Where the platform has them (`LayerOps.lora_bgmv`: the CPU's kernels for bf16, csrc/
lora_bgmv.cpp), each token's products gather its own slot's A and B (Punica's BGMV proper): one
shrink per input group, one expand per projection, for any number of tokens, each token's work
its own adapter's rank only; the stacks are then kept transposed (`LoRAStacks`, `bgmv`), and the
fused CPU decode layer calls the same kernels (`fused_operands`), so decode steps with adapters
stay one compiled call per layer, bit for bit the hooked modules. Elsewhere (float32, CUDA, no
kernels) the two torch paths below run.

Per step, `StepMapping` says which slot each token is in (base tokens: none). Small steps
(decode) take the dense path (Punica's BGMV): one shrink of every token against every slot's A
(one for q/k/v together and one for gate/up, which read the same input), each token's row masked
to its own slot's block, one expand against every slot's B: `y += mask(x A_all^T) B_all^T`,
two products per projection whatever the number of adapters, base tokens adding exact zeros.
Steps of `SEGMENT_MIN_TOKENS` or more (prompts), where the dense path's work over every slot
would show, take the segmented path (SGMV): the adapter tokens gathered once in slot order, one
shrink and one expand per slot's segment, added back with one index_add.

NOTE: every product goes through `layers.linear.linear`, whose per-row results do not depend on
the batch; both paths reduce over slot blocks of r_max columns whose unused entries are exact
zeros, so a token's result depends neither on its slot, the other adapters, the table's size,
nor the path its step took (checked in tests/lora/test_lora_layers.py for the kernels this
machine runs, and end to end in tests/lora/test_lora_engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.layers.linear import linear
from pagedserve.platforms import DEFAULT_OPS
from pagedserve.lora.adapter import projections


# Steps of at least this many tokens take the segmented path (see the module docstring).
SEGMENT_MIN_TOKENS = 64


@dataclass
class StepMapping:
    """This step's tokens by adapter slot, for one of two paths:

    - `mask` [T, slots, 1] (one-hot in the model dtype, zero rows for base tokens): the dense
      path of small steps (decode);
    - `perm` (the flat-batch indices of the adapter tokens, ordered by slot) and `segments`
      ((slot, start, length) runs of `perm`): the segmented path of large steps (prompts).

    `slots`: the slots the step uses; `token_slots` [T] int64: each token's slot (-1: base),
    for the per-token kernels (`bgmv`)."""

    slots: frozenset[int]
    mask: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    segments: tuple[tuple[int, int, int], ...] = ()
    token_slots: torch.Tensor | None = None

    @classmethod
    def build(cls, row_slots: list[int], row_tokens: list[int], num_slots: int,
              dtype: torch.dtype, device: torch.device,
              bgmv: bool = False) -> StepMapping | None:
        """The mapping for rows of `row_tokens` tokens each in slots `row_slots` (-1: the base
        model); None when no row carries an adapter. `bgmv`: for the per-token kernels (only
        `token_slots`)."""
        used = frozenset(s for s in row_slots if s >= 0)
        if not used:
            return None
        if bgmv:
            return cls(used, token_slots=torch.repeat_interleave(
                torch.tensor(row_slots, dtype=torch.long),
                torch.tensor(row_tokens, dtype=torch.long)).to(device))
        if sum(row_tokens) < SEGMENT_MIN_TOKENS:
            per_token = torch.repeat_interleave(torch.tensor(row_slots, dtype=torch.long),
                                                torch.tensor(row_tokens, dtype=torch.long))
            mask = per_token.unsqueeze(1) == torch.arange(num_slots).unsqueeze(0)  # [T, slots]
            return cls(used, mask=mask.to(dtype).unsqueeze(-1).to(device))
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
        return cls(used, perm=torch.tensor(perm, dtype=torch.long, device=device),
                   segments=tuple(segments))


# The projections that read the same input share one shrink: (group, member index). Latent
# attention's q_a_proj (or q_proj) and kv_a_proj_with_mqa read the layer's input as q/k/v do;
# its q_b_proj reads the normed q_a.
GROUPS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
          "q_a_proj": ("qkv", 0), "kv_a_proj_with_mqa": ("qkv", 1), "q_b_proj": ("q_b", 0),
          "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
GROUP_SIZES = {"qkv": 3, "o": 1, "q_b": 1, "gate_up": 2, "down": 1}
# The fused CPU decode layer's projection order (its groups' members in turn)
FUSED_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAStacks:
    """The slot table's tensors, per layer and input group (q/k/v, o, gate/up, down: the
    projections of one input share their A stack and its shrink) and per projection (B), created
    when a loaded adapter first targets them; and the step's `mapping` (None: no adapter this
    step, the hooks and the fused decode layer do nothing different).

    Layout, slot-major, zero beyond each adapter's rank: A [slots, members * r_max, in] (member
    m's A in rows m * r_max ..), B [out, slots, r_max] (and per slot, `b_slot`); with `bgmv`
    (the platform's per-token kernels, `ops.lora_bgmv`) transposed instead: A^T [slots, in,
    members * r_max], B^T [slots, r_max, out]."""

    def __init__(self, num_slots: int, max_rank: int, dims: dict[str, tuple[int, int]],
                 dtype: torch.dtype, device: torch.device, ops=DEFAULT_OPS) -> None:
        self.num_slots, self.max_rank, self.dims = num_slots, max_rank, dims
        self.dtype, self.device, self.ops = dtype, device, ops
        self.bgmv = ops.lora_bgmv(dtype, torch.device(device))
        self.a: dict[tuple[int, str], torch.Tensor] = {}  # (layer, group)
        self.b: dict[tuple[int, str], torch.Tensor] = {}  # (layer, module)
        # the same B per slot, [slots, out, r_max]: the segmented path's contiguous operands
        self.b_slot: dict[tuple[int, str], torch.Tensor] = {}
        self.present: dict[tuple[int, str], set[int]] = {}  # slots adapting the projection
        self.mapping: StepMapping | None = None
        # the last shrink: ((layer, group), its input, its result)
        self._shrunk: tuple | None = None

    def set_mapping(self, mapping: StepMapping | None) -> None:
        self.mapping, self._shrunk = mapping, None

    def put(self, slot: int, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor) -> None:
        """Write one projection's A [r, in] / B [out, r] into `slot`."""
        layer, module = key
        d_in, d_out = self.dims[key]
        group, member = GROUPS[module]
        gkey, rmax = (layer, group), self.max_rank
        if self.bgmv:
            self._put_transposed(slot, key, gkey, member, a, b)
            return
        if gkey not in self.a:
            self.a[gkey] = torch.zeros(self.num_slots, GROUP_SIZES[group] * rmax, d_in,
                                       dtype=self.dtype, device=self.device)
        if key not in self.b:
            self.b[key] = torch.zeros(d_out, self.num_slots, rmax, dtype=self.dtype,
                                      device=self.device)
            self.b_slot[key] = torch.zeros(self.num_slots, d_out, rmax, dtype=self.dtype,
                                           device=self.device)
            self.present[key] = set()
        r = a.shape[0]
        rows = self.a[gkey][slot, member * rmax:(member + 1) * rmax]
        rows.zero_()
        rows[:r].copy_(a)
        self.b[key][:, slot].zero_()
        self.b[key][:, slot, :r].copy_(b)
        self.b_slot[key][slot].copy_(self.b[key][:, slot])
        self.present[key].add(slot)
        self._shrunk = None

    def _put_transposed(self, slot, key, gkey, member, a, b) -> None:
        (d_in, d_out), rmax = self.dims[key], self.max_rank
        if gkey not in self.a:
            self.a[gkey] = torch.zeros(self.num_slots, d_in, GROUP_SIZES[gkey[1]] * rmax,
                                       dtype=self.dtype, device=self.device)
        if key not in self.b:
            self.b[key] = torch.zeros(self.num_slots, rmax, d_out, dtype=self.dtype,
                                      device=self.device)
            self.present[key] = set()
        cols = self.a[gkey][slot, :, member * rmax:(member + 1) * rmax]
        cols.zero_()
        cols[:, :a.shape[0]].copy_(a.t())
        self.b[key][slot].zero_()
        self.b[key][slot, :b.shape[1]].copy_(b.t())
        self.present[key].add(slot)
        self._shrunk = None

    def clear(self, slot: int) -> None:
        """Forget what `slot` held (its projections no longer adapted; their blocks zeroed)."""
        rmax = self.max_rank
        for (layer, module), slots in self.present.items():
            if slot in slots and self.bgmv:
                slots.discard(slot)
                group, member = GROUPS[module]
                self.a[(layer, group)][slot, :, member * rmax:(member + 1) * rmax].zero_()
                self.b[(layer, module)][slot].zero_()
            elif slot in slots:
                slots.discard(slot)
                group, member = GROUPS[module]
                self.a[(layer, group)][slot, member * rmax:(member + 1) * rmax].zero_()
                self.b[(layer, module)][:, slot].zero_()
                self.b_slot[(layer, module)][slot].zero_()
        self._shrunk = None

    def _shrink(self, layer: int, group: str, x: torch.Tensor):
        """x A^T for the projections that share `x`, computed once: dense, [T, slots, members,
        r_max] masked to each token's slot; segmented, one [n, members * r_max] per segment."""
        gkey = (layer, group)
        last = self._shrunk
        if last is not None and last[0] == gkey and last[1] is x:
            return last[2]
        m, a = self.mapping, self.a[gkey]
        if self.bgmv:
            h = self.ops.lora_shrink(x, a, m.token_slots)  # [T, members * r_max] fp32
        elif m.mask is not None:
            t = x.shape[0]
            h = linear(x, a.view(-1, a.shape[-1])).view(t, self.num_slots, GROUP_SIZES[group],
                                                         self.max_rank)
            h.mul_(m.mask.unsqueeze(-1))  # each token's own slot only (base tokens: 0)
        else:
            xs = x.index_select(0, m.perm)  # [Ta, in], by slot
            h = [linear(xs[start:start + n], a[slot]) for slot, start, n in m.segments]
        self._shrunk = (gkey, x, h)  # NOTE: holds x, so its identity cannot be reused
        return h

    def fused_operands(self, layer: int) -> tuple | None:
        """This step's adapters of decoder layer `layer` for the fused CPU decode layer
        (`kernels.cpu_decoder_layer.decoder_layer`'s `lora`): the tokens' slots, A^T per group
        (q/k/v, o, gate/up, down) and B^T per projection (q, k, v, o, gate, up, down), None where
        `apply` adds nothing (a group's A: when none of its members has a B), and r_max; None
        without the per-token kernels (`bgmv`). NOTE: the fused layer calls the same kernels in
        the same order as `apply` after each projection's base product: the same bits."""
        if not self.bgmv:
            return None
        m = self.mapping
        bs = []
        for module in FUSED_ORDER:
            present = self.present.get((layer, module))
            bs.append(None if not present or present.isdisjoint(m.slots)
                      else self.b[(layer, module)])
        a_s, start = [], 0
        for group in ("qkv", "o", "gate_up", "down"):
            n = GROUP_SIZES[group]
            skip = all(b is None for b in bs[start:start + n])
            a_s.append(None if skip else self.a[(layer, group)])
            start += n
        return m.token_slots, a_s, bs, self.max_rank

    def apply(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base product of `x` [T, in], [T, out]) plus each adapter token's
        x A^T B^T, in place."""
        m, present = self.mapping, self.present.get(key)
        if m is None or not present or present.isdisjoint(m.slots):
            return y
        layer, module = key
        group, member = GROUPS[module]
        h, b, rmax = self._shrink(layer, group, x), self.b[key], self.max_rank
        if self.bgmv:  # each token its own slot's B
            self.ops.lora_expand_(y, h, member * rmax, b, m.token_slots)
            return y
        if m.mask is not None:  # one expand over every slot
            hm = h[:, :, member].reshape(x.shape[0], -1)  # [T, slots * r_max]
            return y.add_(linear(hm, b.view(b.shape[0], -1)))
        cols = slice(member * rmax, (member + 1) * rmax)
        parts, index = [], []
        for (slot, start, n), hs in zip(m.segments, h):
            if slot in present:
                parts.append(linear(hs[:, cols], self.b_slot[key][slot]))  # [n, out]
                index.append(m.perm[start:start + n])
        if parts:
            y.index_add_(0, torch.cat(index) if len(index) > 1 else index[0],
                         torch.cat(parts) if len(parts) > 1 else parts[0])
        return y


def install_hooks(model: torch.nn.Module, stacks: LoRAStacks) -> int:
    """Hook every adaptable projection of `model`'s decoder layers (`lora.adapter.projections`:
    attention and dense-MLP projections; a layer without attention, as a hybrid's linear-attention
    or convolution layers, takes none); mark each hooked layer (`lora_stacks`, `lora_index`: the
    fused CPU decode layer, which bypasses the hooks, adds the products itself from
    `LoRAStacks.fused_operands`). ValueError for a model with none. Returns the number of hooks."""
    layers = model.backbone().decoder_layers()
    count = 0
    for i, layer in enumerate(layers):
        # NOTE: a mixture-of-experts block (layers/moe.py) has no gate/up/down modules: its
        # experts take no adapter (an adapter's weights for them are refused when read)
        found = projections(layer)
        for name, module in found.items():
            if getattr(module, "tp", None) is not None and module.tp.is_parallel:
                raise ValueError("enable_lora: tensor-parallel LoRA is not supported")
            module.register_forward_hook(_hook(stacks, (i, name)))
            count += 1
        if found:
            layer.lora_stacks, layer.lora_index = stacks, i
    if not count:
        raise ValueError(f"enable_lora: {type(model).__name__} has no projection LoRA adapts "
                         "(q/k/v/o, latent attention's q_a / q_b / kv_a, gate/up/down)")
    return count


def _hook(stacks: LoRAStacks, key: tuple[int, str]):
    def hook(module, args, out):
        if stacks.mapping is None:
            return None
        return stacks.apply(key, args[0], out)

    return hook
