"""Cohere 2 (`Cohere2ForCausalLM`: Command R7B, Command A): Command-R's parallel block
(`models.cohere`) with sliding-window layers.

Differences from Cohere, as in HF 5.x:
- `layer_types[i]` picks a sliding window (`sliding_window`) or full attention; older configs
  give `sliding_window_pattern` instead (HF's default 4: three sliding layers, then a full one);
- only the sliding layers apply RoPE: full-attention layers see no positions at all (NoPE);
  HF ties RoPE to the layer's window, so with no `sliding_window` no layer rotates, as here;
- no q/k norms; head_dim is hidden_size / num_attention_heads (HF's config sets it so).
The sliding and full layers are two KV cache groups (`core.kv_spec.SlidingWindowSpec` on the
sliding ones, from their attention's window): a sequence holds only the window on those.
From GGUF: llama.cpp's "cohere2" (`attention.sliding_window`, its pattern or llama.cpp's default
of 4; zero biases dropped by the converter).
"""

from __future__ import annotations

from typing import Any

from pagedserve.models.cohere import CohereDecoderLayer, CohereForCausalLM, CohereModel


def cohere2_layer_types(config: Any) -> list[str]:
    """`config.layer_types`, or every `sliding_window_pattern`-th layer full (HF's default 4)."""
    types = getattr(config, "layer_types", None)
    if types is None:
        period = int(getattr(config, "sliding_window_pattern", None) or 4)
        types = ["sliding_attention" if (i + 1) % period else "full_attention"
                 for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    return list(types)


class Cohere2DecoderLayer(CohereDecoderLayer):
    """Cohere's parallel block; RoPE on the sliding-window layers only, no q/k norms."""

    @staticmethod
    def uses_qk_norm(config: Any) -> bool:
        return False  # HF's Cohere 2 attention has none (a `use_qk_norm` key is ignored, as HF)

    @staticmethod
    def uses_rope(sliding_window: int | None) -> bool:
        # NOTE: HF's rule (`if self.sliding_window is not None`): full layers see no positions
        return sliding_window is not None


class Cohere2Model(CohereModel):
    layer_class = Cohere2DecoderLayer


class Cohere2ForCausalLM(CohereForCausalLM):
    """Command R7B / Command A decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = Cohere2Model

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        window = getattr(config, "sliding_window", None)
        return [window if t == "sliding_attention" else None for t in cohere2_layer_types(config)]
