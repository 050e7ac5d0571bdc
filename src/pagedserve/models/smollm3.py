"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama decoder with no RoPE on some layers (NoPE).

Differences from Llama, as in HF 5.x:
- `no_rope_layers[i]` is 0 for the layers that use no position embedding (by default every
  fourth: `no_rope_layer_interval`), 1 for the others;
- sliding windows only with `use_sliding_window` (then on the `layer_types` "sliding_attention").
A NoPE layer gets the identity rotation (cos 1, sin 0): `q * 1 + rotate(q) * 0` is `q` bit for bit,
so every layer stays Llama's -- the fused decode path included.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.models.llama import LlamaForCausalLM, LlamaModel, layer_sliding_windows


def smollm3_rope_layers(config: Any) -> list[bool]:
    """Whether each layer applies RoPE (`no_rope_layers`, or every `no_rope_layer_interval`-th
    layer without, as HF's config derives it)."""
    flags = getattr(config, "no_rope_layers", None)
    if flags is None:
        interval = getattr(config, "no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(config.num_hidden_layers)]
    if len(flags) != config.num_hidden_layers:
        raise ValueError(f"config.no_rope_layers has {len(flags)} entries for {config.num_hidden_layers} layers")
    return [bool(f) for f in flags]


def identity_rope_for(extras: list[tuple], use_rope: list[bool]) -> list[tuple]:
    """Per-layer `(rope,)` extras with the layers of `use_rope` False given the identity
    rotation (cos 1, sin 0: NoPE, bit for bit)."""
    if all(use_rope):
        return extras
    cos, sin = extras[0][0]  # [T, D]
    identity = (torch.ones_like(cos), torch.zeros_like(sin))
    return [e if rope else (identity,) for e, rope in zip(extras, use_rope)]


class SmolLM3Model(LlamaModel):
    """Llama's stack; the NoPE layers get identity cos/sin tables."""

    def __init__(self, config: Any, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.use_rope = smollm3_rope_layers(config)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x, extras = super().embed(input_ids, positions)
        return x, identity_rope_for(extras, self.use_rope)


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3 decoder-only LM on a paged KV cache (tied head by default, as HF's config)."""

    model_class = SmolLM3Model
    tied_by_default = True

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        if not getattr(config, "use_sliding_window", False):
            return [None] * config.num_hidden_layers
        return layer_sliding_windows(config)
