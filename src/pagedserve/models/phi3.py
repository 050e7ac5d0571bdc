"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): the Llama decoder with fused projections.

Differences from Llama, as in HF 5.x:
- the checkpoint fuses q/k/v into `self_attn.qkv_proj` ([q; k; v] rows) and gate/up into
  `mlp.gate_up_proj` ([gate; up] rows); we split them while loading into Llama's separate
  projections (`layers.weights.split_fused_weights`), so the layer is Llama's and runs the fused
  decode path unchanged, and a tensor-parallel shard reads only its rows;
- LongRoPE (`rope_type` "longrope"; Phi-3's older names "su" and "yarn" mean it too, as HF's
  `Phi3Config` says) with `original_max_position_embeddings` from the config (`layers.rotary`);
- `partial_rotary_factor` (Phi-4-mini: 0.75): RoPE on the first part of each head;
- `sliding_window` (when set) on every layer, as HF's Phi-3 mask.
"""

from __future__ import annotations

from typing import Any, Iterable

from pagedserve.layers.weights import split_fused_weights
from pagedserve.models.llama import LlamaForCausalLM, head_dim_of


def phi3_rope_config(config: Any) -> Any:
    """`config` with Phi-3's legacy rope type names ("su", "yarn": LongRoPE) read as "longrope"
    (in place: a transformers 4 `rope_scaling`, or a dict that skipped `Phi3Config`)."""
    for attr in ("rope_parameters", "rope_scaling"):
        params = getattr(config, attr, None)
        if isinstance(params, dict):
            kind = params.get("rope_type") or params.get("type")
            if kind in ("su", "yarn"):
                params["rope_type"] = "longrope"
                params.pop("type", None)
    return config


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 decoder-only LM on a paged KV cache: Llama's layers, the fused checkpoint tensors
    split at load."""

    def __init__(self, config: Any, **kwargs):
        super().__init__(phi3_rope_config(config), **kwargs)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        c = self.config
        d = head_dim_of(c)
        q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
        fused = {
            "self_attn.qkv_proj": lambda: [("self_attn.q_proj", q), ("self_attn.k_proj", kv),
                                           ("self_attn.v_proj", kv)],
            "mlp.gate_up_proj": lambda: [("mlp.gate_proj", c.intermediate_size),
                                         ("mlp.up_proj", c.intermediate_size)],
        }
        super().load_weights(split_fused_weights(weights, fused))
