"""The text decoders of Qwen's vision-language checkpoints, served text-only:
`Qwen2VLForConditionalGeneration` and `Qwen2_5_VLForConditionalGeneration` (Qwen2's decoder),
`Qwen3VLForConditionalGeneration` (Qwen3's, q/k norms) and `Qwen3VLMoeForConditionalGeneration`
(Qwen3-MoE's: Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B).

Their decoders use multimodal RoPE (M-RoPE): the head's frequencies are split into sections
rotated by a temporal, a height and a width position (`mrope_section`, interleaved in Qwen3-VL).
For text-only inputs HF gives a token the same position in all three (`get_rope_index` without
images), so every section rotates by the token's position: M-RoPE is then exactly the 1D RoPE of
`rope_theta`, which is what we run. The vision tower (`visual`) is skipped
(`models.multimodal_text`).

Qwen3-VL-MoE's experts are stored fused, `experts.gate_up_proj` / `experts.down_proj`: its
released checkpoints as `[E, H, 2I]` / `[E, I, H]`, transformers 5's `save_pretrained` as its
modules hold them, `[E, 2I, H]` / `[E, H, I]`; both are split onto the stacked experts by their
shapes, as transformers reads them (`models.fused_experts`). Its router always renormalizes the
top-k (the config has no `norm_topk_prob`).

llama.cpp writes these text decoders as architectures "qwen2vl", "qwen3vl" and "qwen3vlmoe"
(`models.gguf_arch_config`: read as Qwen2 / Qwen3 / Qwen3-MoE).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

from pagedserve.layers.moe import MoERouting
from pagedserve.models.fused_experts import split_fused_experts
from pagedserve.models.multimodal_text import TextOfMultimodal, text_config_of
from pagedserve.models.qwen2 import Qwen2ForCausalLM
from pagedserve.models.qwen3 import Qwen3ForCausalLM
from pagedserve.models.qwen3_moe import Qwen3MoeForCausalLM

# M-RoPE's own keys: with one position for all three sections they change nothing
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def text_only_rope(text: Any) -> Any:
    """A copy of the text config whose RoPE parameters are M-RoPE's as the 1D RoPE they equal
    on text-only positions (the section keys dropped; rope type "mrope" -> "default")."""
    text = copy.copy(text)
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(text, attr, None)
        if isinstance(params, dict):
            params = {k: v for k, v in params.items() if k not in _MROPE_KEYS}
            for key in ("rope_type", "type"):
                if params.get(key) == "mrope":
                    params[key] = "default"
            setattr(text, attr, params)
    return text


class _QwenVLText(TextOfMultimodal):
    """`TextOfMultimodal` for Qwen's VL checkpoints: their vision tower is `visual`."""

    _SKIP = TextOfMultimodal._SKIP + ("model.visual.", "visual.")

    def __init__(self, config: Any, **kwargs):
        config = copy.copy(config)
        text = text_only_rope(text_config_of(config))
        config.text_config = text  # (what get_text_config returns then)
        super().__init__(config, **kwargs)


class Qwen2VLForConditionalGeneration(_QwenVLText, Qwen2ForCausalLM):
    """Qwen2-VL's text decoder (Qwen2's), text-only inputs (see the module docstring)."""


class Qwen2_5_VLForConditionalGeneration(_QwenVLText, Qwen2ForCausalLM):
    """Qwen2.5-VL's text decoder (Qwen2's), text-only inputs (see the module docstring)."""


class Qwen3VLForConditionalGeneration(_QwenVLText, Qwen3ForCausalLM):
    """Qwen3-VL's text decoder (Qwen3's: q/k norms), text-only inputs (see the module
    docstring). Its DeepStack features join image positions only: none in text."""


class Qwen3VLMoeForConditionalGeneration(_QwenVLText, Qwen3MoeForCausalLM):
    """Qwen3-VL-MoE's text decoder (Qwen3-MoE's, experts in every layer off `mlp_only_layers`),
    text-only inputs; its fused experts split at load (see the module docstring)."""

    def routing(self, config: Any) -> MoERouting:
        """HF's `Qwen3VLMoeTextTopKRouter`: softmax top-k, always renormalized."""
        return MoERouting.from_config(config, renormalize=True)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The checkpoint's tensors, the fused experts in either layout split onto the stacked
        experts (a GGUF file's, already stacked, pass through)."""
        text = text_config_of(self.config)
        super().load_weights(split_fused_experts(
            weights, sizes=(int(text.hidden_size), int(text.moe_intermediate_size))))
