"""CWM (`CwmForCausalLM`: Meta's Code World Model).

Llama's decoder, as in HF 5.x, with sliding-window layers: `layer_types` (HF's default: every
fourth layer, from the first, full; the others a window of `sliding_window`, 8192 by default),
no attention biases, Llama 3's RoPE scaling by default (`rope_parameters`). Llama's per-layer
windows (`llama.layer_sliding_windows`) and fused decode layer serve it unchanged.
HF folders only: llama.cpp's converter has no CWM.
"""

from __future__ import annotations

from pagedserve.models.llama import LlamaForCausalLM


class CwmForCausalLM(LlamaForCausalLM):
    """CWM decoder-only LM on a paged KV cache (see the module docstring)."""

