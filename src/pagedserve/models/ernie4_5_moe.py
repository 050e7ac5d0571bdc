"""ERNIE 4.5 MoE (`Ernie4_5_MoeForCausalLM`, e.g. ERNIE-4.5-21B-A3B): Llama-style layers with
GLM's RoPE layout and a mixture of experts with a selection bias.

As in HF 5.x:
- RoPE over the whole head on interleaved pairs (`layers.rotary`, `interleaved=True`, as GLM's);
- `use_bias`: q / k / v / o, the dense MLPs, the shared experts and the LM head have biases (the
  routed experts none);
- experts in the layers `moe_layer_start_index <= i <= moe_layer_end_index` with
  `(i + 1) % moe_layer_interval == 0`, dense gated MLPs elsewhere;
- the router (float32) takes the top-k of softmax scores plus `moe_statics.e_score_correction_bias`
  (selection only), weighs them by the softmax scores renormalized (HF clamps the sum at
  `moe_norm_min`, 1e-12: top-k softmax scores never sum below k / num_experts), beside
  `moe_num_shared_experts` shared experts as one plain MLP;
- HF ignores the checkpoints' multi-token-prediction tensors (`mtp*`); so do we.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from pagedserve.distributed.tp import TPContext
from pagedserve.layers.moe import FusedMoE, MoERouting
from pagedserve.models.base import LMHeadBias
from pagedserve.models.llama import LlamaAttention, LlamaMLP, head_dim_of
from pagedserve.models.mixtral import MoECausalLM, MoEModel


def is_moe_layer(config: Any, i: int) -> bool:
    """Whether HF's ERNIE 4.5 puts experts in layer `i`."""
    start = int(getattr(config, "moe_layer_start_index", 0))
    end = getattr(config, "moe_layer_end_index", None)
    end = config.num_hidden_layers - 1 if end is None or int(end) < 0 else int(end)
    interval = int(getattr(config, "moe_layer_interval", 1) or 1)
    return (i + 1) % interval == 0 and start <= i <= end


class Ernie4_5_MoeModel(MoEModel):
    """Mixtral's stack with RoPE on interleaved pairs."""

    rope_interleaved = True


class Ernie4_5_MoeForCausalLM(LMHeadBias, MoECausalLM):
    """ERNIE 4.5 MoE decoder-only LM on a paged KV cache (see the module docstring)."""

    model_class = Ernie4_5_MoeModel
    tied_by_default = True
    moe_aliases = {".mlp.moe_statics.e_score_correction_bias": ".mlp.gate.e_score_correction_bias",
                   ".mlp.shared_experts.": ".mlp.shared_expert."}

    def __init__(self, config: Any, **kwargs):
        super().__init__(config, **kwargs)
        self.init_lm_head_bias(config.vocab_size, bool(getattr(config, "use_bias", False)))

    @staticmethod
    def num_experts(config: Any) -> int:
        return int(config.num_experts)

    @staticmethod
    def sliding_windows(config: Any) -> list[int | None]:
        return [None] * config.num_hidden_layers

    def make_attention(self, config: Any, tp: TPContext) -> Callable[[int], nn.Module]:
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "use_bias", False))
        return lambda i: LlamaAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
            scale=head_dim**-0.5, sliding_window=None, qkv_bias=bias, o_bias=bias, tp=tp,
            rope_interleaved=True)

    def make_mlp(self, config: Any, layer: int, tp: TPContext) -> nn.Module:
        bias = bool(getattr(config, "use_bias", False))
        if not is_moe_layer(config, layer):
            return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias, tp=tp)
        routing = MoERouting(top_k=int(config.num_experts_per_tok), scoring="softmax", renormalize=True,
                             correction_bias=True, router_fp32=True)
        shared = int(getattr(config, "moe_num_shared_experts", 0) or 0) * config.moe_intermediate_size
        return FusedMoE(config.hidden_size, config.moe_intermediate_size, self.num_experts(config), routing,
                        act=config.hidden_act, shared_intermediate_size=shared, shared_act=config.hidden_act,
                        shared_bias=bias, tp=tp, expert_parallel=self.expert_placement.expert_parallel)

    def load_weights(self, weights) -> None:
        """ERNIE 4.5 MoE checkpoint tensors (HF names, or a GGUF file's mapped to them); the
        correction bias, stored `[1, E]`, as `[E]`."""
        from pagedserve.layers.weights import read_full

        def flat(pairs):
            for name, source in pairs:
                if name.endswith((".moe_statics.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")):
                    source = read_full(source).reshape(-1)  # [E] (HF and GGUF store [1, E])
                yield name, source

        super().load_weights(flat(weights))

    def _rename(self, name: str) -> str | tuple | None:
        if name.startswith(("mtp", "model.mtp")):
            return None  # multi-token-prediction tensors (see the module docstring)
        return super()._rename(name)
