"""Fused expert tensors of HF checkpoints, split onto the MoE layer's stacked layout.

Some checkpoints store a layer's experts as two 3-D tensors: `experts.gate_up_proj` (each
expert's gate and up projections side by side, gate first) and `experts.down_proj`. Our
`layers.moe.FusedMoE` holds `gate_proj` / `up_proj` `[E, I, H]` and `down_proj` `[E, H, I]`
(`[out, in]` per expert, as `nn.Linear`). Two layouts of the fused tensors exist:

- "in, out" (`x @ W`): `gate_up_proj` `[E, H, 2I]`, `down_proj` `[E, I, H]` -- Llama 4's
  checkpoints (and HF's Llama 4 modules), Qwen3-VL-MoE's released checkpoints;
- "out, in" (`W @ x`): `gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]` -- transformers 5's
  in-memory experts (Qwen3-MoE's, Qwen3-VL-MoE's), which `save_pretrained` writes as they are.

`split_fused_experts` yields the stacked tensors from either (`models.llama4`,
`models.qwen_vl`).
"""

from __future__ import annotations

from typing import Any, Iterable

_GATE_UP, _DOWN = ".experts.gate_up_proj", ".experts.down_proj"


def split_fused_experts(weights: Iterable[tuple[str, Any]], *,
                        sizes: tuple[int, int] | None = None) -> Iterable[tuple[str, Any]]:
    """`...experts.gate_up_proj` -> `...experts.gate_proj` / `up_proj` `[E, I, H]` (first / last
    I of the fused dimension), `...experts.down_proj` -> `[E, H, I]`; other tensors (per-expert
    or already stacked ones, e.g. a GGUF file's) pass through.

    `sizes`: None reads the fused tensors as "in, out" (Llama 4's; see the module docstring);
    `(hidden_size, moe_intermediate_size)` tells the layout by the shapes, as transformers'
    `Transpose(check_dims=True)` does for Qwen3-VL-MoE: a tensor already in the "out, in" shape
    is taken as it is, one in the "in, out" shape transposed, any other shape is a ValueError.
    NOTE: where both shapes are the same (H == 2I for gate_up, H == I for down) the tensor is
    taken as "out, in", HF's choice too.
    """
    from pagedserve.layers.weights import read_full

    for name, source in weights:
        if name.endswith(_GATE_UP):
            t = _out_in(read_full(source), name, sizes, fused=True)  # [E, 2I, H]
            inter = t.shape[1] // 2
            stem = name[: -len("gate_up_proj")]
            yield stem + "gate_proj", t[:, :inter].contiguous()  # [E, I, H]
            yield stem + "up_proj", t[:, inter:].contiguous()  # [E, I, H]
        elif name.endswith(_DOWN):
            yield name, _out_in(read_full(source), name, sizes, fused=False).contiguous()  # [E, H, I]
        else:
            yield name, source


def _out_in(t: Any, name: str, sizes: tuple[int, int] | None, *, fused: bool) -> Any:
    """`t` (a fused expert tensor, 3-D) in the "out, in" layout: `[E, 2I, H]` (gate_up, `fused`)
    or `[E, H, I]` (down)."""
    if t.dim() != 3:
        raise ValueError(f"{name}: a fused expert tensor must be 3-D [experts, ., .]; got {tuple(t.shape)}")
    if sizes is None:
        return t.transpose(1, 2)
    hidden, inter = sizes
    out_in = (2 * inter, hidden) if fused else (hidden, inter)
    if tuple(t.shape[1:]) == out_in:
        return t
    if tuple(t.shape[1:]) == out_in[::-1]:
        return t.transpose(1, 2)
    raise ValueError(f"{name}: shape {tuple(t.shape)} fits neither [E, {out_in[0]}, {out_in[1]}] nor "
                     f"[E, {out_in[1]}, {out_in[0]}] (hidden_size {hidden}, moe_intermediate_size {inter})")
