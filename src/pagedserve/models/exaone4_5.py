"""EXAONE 4.5's text decoder (`Exaone4_5_ForConditionalGeneration`, LG AI Research), served
text-only.

The checkpoint is EXAONE 4.0's decoder (`models.exaone4`: post-norms, per-head q/k norms,
sliding layers with RoPE and global ones without) under `model.language_model.`, beside a
Qwen2-VL-style vision tower (`model.visual.`, skipped) and, in the released ones, a
multi-token-prediction block (`mtp.`, skipped: HF does not run it either). Text positions are
plain 1D positions (HF's 2D RoPE is the vision tower's); the LM head's tie follows the outer
config (`multimodal_text.TextOfMultimodal`).
From GGUF: llama.cpp writes the text decoder as architecture "exaone4" (its MTP blocks counted
in `block_count`, `nextn_predict_layers` of them: skipped, `models.gguf_arch_config`).
"""

from __future__ import annotations

from pagedserve.models.exaone4 import Exaone4ForCausalLM
from pagedserve.models.multimodal_text import TextOfMultimodal


class Exaone4_5_ForConditionalGeneration(TextOfMultimodal, Exaone4ForCausalLM):
    """EXAONE 4.5's text decoder on a paged KV cache (see the module docstring)."""

    _SKIP = TextOfMultimodal._SKIP + ("model.visual.", "visual.", "mtp.")
