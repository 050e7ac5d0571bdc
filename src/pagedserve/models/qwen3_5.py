"""Qwen3.5 (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) and the text decoders of its
multimodal checkpoints (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`): Qwen3-Next's hybrid decoder (`models.qwen3_next`) with
the DeltaNet projections stored split (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).
The dense model has a SwiGLU MLP in every layer; the MoE model Qwen3-Next's sparse block in
every layer, its top-k always renormalized. Their M-RoPE equals 1D RoPE on text positions
(`models.qwen_vl.text_only_rope`); vision weights are skipped.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.distributed.tp import TPContext
from pagedserve.layers.moe import MoERouting
from pagedserve.models.llama import LlamaMLP
from pagedserve.models.qwen3_next import Qwen3NextForCausalLM
from pagedserve.models.qwen_vl import _QwenVLText


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 dense: the hybrid decoder with a SwiGLU MLP in every layer."""

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, tp=tp)

    def _rename(self, name: str) -> str | tuple | None:
        if name.startswith("model.language_model."):  # (HF's Qwen3.5 text prefix change)
            name = "model." + name[len("model.language_model."):]
        return super()._rename(name)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 MoE: the sparse block (shared expert with its sigmoid gate) in every layer, the
    chosen experts' weights always renormalized (HF's router has no `norm_topk_prob`)."""

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        return self.make_moe(config, MoERouting.from_config(config, renormalize=True), tp)


class Qwen3_5ForConditionalGeneration(_QwenVLText, Qwen3_5ForCausalLM):
    """Qwen3.5's text decoder of a multimodal checkpoint, text-only inputs."""


class Qwen3_5MoeForConditionalGeneration(_QwenVLText, Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE's text decoder of a multimodal checkpoint, text-only inputs."""
