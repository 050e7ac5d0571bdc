"""MiniMax-M2 (`MiniMaxM2ForCausalLM`): Mixtral's decoder with OLMoE's (FlexOlmo's) attention,
partial rotate-half RoPE and a sigmoid router with a selection bias.

As in HF 5.x (`modeling_minimax_m2.py`, from Mixtral, FlexOlmo's attention and Glm4Moe's rotary):
- attention: q / k / v / o without biases; one RMSNorm over the *whole* q projection
  `[Hq*D]` and one over the whole k projection `[Hkv*D]` (not per head; under tensor
  parallelism the mean of squares is summed over the ranks: `models.olmoe.OlmoeAttention`),
  then RoPE over the first `partial_rotary_factor` of each head (config.json's legacy
  `rotary_dim`, read by HF as `rotary_dim / head_dim`) in the rotate-half layout, GQA;
- the router (`block_sparse_moe.gate`, no bias): sigmoid of the logits in float32; the top
  `num_experts_per_tok` chosen by `scores + e_score_correction_bias` (a buffer of the MoE block,
  ours `mlp.gate.e_score_correction_bias`), weighed by the unbiased scores divided by their sum
  (no epsilon, no `routed_scaling_factor`: HF has neither); experts `w1` / `w3` / `w2` SwiGLU;
- no sliding window; embeddings untied by default;
- MiniMax's config.json counts multi-token-prediction modules (`num_mtp_modules`); HF's model
  runs none and neither do we: tensors of layers past `num_hidden_layers`
  (`model.layers.<num_hidden_layers + i>`, as DeepSeek-V3's and GLM-4.5's) are skipped at load.
NOTE: partial RoPE keeps a decode step off the CPU platform's fused attention half (its kernel
rotates whole heads); these layers run their modules there.

llama.cpp writes it as architecture "minimax-m2" (`models.gguf_config`): rotary part as
`rope.dimension_count`, the selection bias as `exp_probs_b`, experts merged per layer, q/k
unpermuted (NEOX RoPE).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from torch import nn

from pagedserve.distributed.tp import TPContext
from pagedserve.layers.moe import MoERouting
from pagedserve.models.mixtral import MixtralForCausalLM
from pagedserve.models.olmoe import OlmoeAttention

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class MiniMaxM2Attention(OlmoeAttention):
    """OLMoE's attention (whole-projection q / k RMSNorms, no clipping, no biases); the rotary
    part of each head comes with the model's cos/sin (`[T, R]`, R <= D)."""

    family = "MiniMax-M2"


def _check_config(config: Any) -> None:
    """ValueError naming a config value HF's MiniMax-M2 has no such thing for (MiniMax's own
    code would run it differently: we follow HF, so refuse rather than guess)."""
    scoring = getattr(config, "scoring_func", None)
    if scoring not in (None, "sigmoid"):
        raise ValueError(f"MiniMax-M2 scoring_func {scoring!r} is not supported (only 'sigmoid')")
    if getattr(config, "attention_bias", False):
        raise ValueError("MiniMax-M2 attention_bias=True is not supported (its projections have no biases)")
    if getattr(config, "clip_qkv", None) is not None:
        raise ValueError(f"MiniMax-M2 clip_qkv {config.clip_qkv} is not supported")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"MiniMax-M2 hidden_act {config.hidden_act!r} is not supported (only 'silu')")


class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    """MiniMax-M2 decoder-only LM on a paged KV cache (see the module docstring): Mixtral's
    experts and checkpoint names (`block_sparse_moe.` -> `mlp.`), `MiniMaxM2Attention`."""

    def __init__(self, config: Any, **kwargs):
        _check_config(config)
        super().__init__(config, **kwargs)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [None] * config.num_hidden_layers

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module]:
        return lambda i: MiniMaxM2Attention(config, tp)

    def routing(self, config: Any) -> MoERouting:
        # NOTE: HF divides by the plain sum (renormalize_eps 0) and scales by nothing
        return MoERouting(top_k=int(config.num_experts_per_tok), scoring="sigmoid", renormalize=True,
                          correction_bias=True)

    def _rename(self, name: str) -> str | tuple | None:
        m = _LAYER.match(name)
        if m is not None and int(m[1]) >= self.config.num_hidden_layers:
            return None  # a multi-token-prediction layer (see the module docstring)
        # the selection bias sits on HF's MoE block (`block_sparse_moe.` / `mlp.`), ours on the router
        name = name.replace(".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
        name = name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
        return super()._rename(name)
