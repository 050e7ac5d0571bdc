"""The text decoders of Qwen's vision-language checkpoints, served text-only:
`Qwen2VLForConditionalGeneration` and `Qwen2_5_VLForConditionalGeneration` (Qwen2's decoder) and
`Qwen3VLForConditionalGeneration` (Qwen3's, q/k norms).

Their decoders use multimodal RoPE (M-RoPE): the head's frequencies are split into sections
rotated by a temporal, a height and a width position (`mrope_section`, interleaved in Qwen3-VL).
For text-only inputs HF gives a token the same position in all three (`get_rope_index` without
images), so every section rotates by the token's position: M-RoPE is then exactly the 1D RoPE of
`rope_theta`, which is what we run. The vision tower (`visual`) is skipped
(`models.multimodal_text`).
"""

from __future__ import annotations

import copy
from typing import Any

from pagedserve.models.multimodal_text import TextOfMultimodal, text_config_of
from pagedserve.models.qwen2 import Qwen2ForCausalLM
from pagedserve.models.qwen3 import Qwen3ForCausalLM

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
