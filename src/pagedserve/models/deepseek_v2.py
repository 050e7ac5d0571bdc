"""DeepSeek V2 / V2-Lite (`DeepseekV2ForCausalLM`) and V3 (`DeepseekV3ForCausalLM`).

Module and parameter names mirror HF's, so checkpoints load by name. Per layer:
- attention: multi-head latent attention (`layers.mla.MLAttention`; the paged cache holds one
  latent row per token), its softmax scale `qk_head_dim ** -0.5` times YaRN's
  `mscale(factor, mscale_all_dim) ** 2` when the rope is scaled (HF's `yarn_apply_mscale`), and
  RoPE on `qk_rope_head_dim` with YaRN's attention factor in cos/sin (`layers.rotary`);
- feed-forward: a dense gated MLP for the first `first_k_dense_replace` layers (and, with
  `moe_layer_freq` > 1, layers off its stride, as vLLM), mixture-of-experts otherwise: routed
  experts with shared experts beside them (`layers.moe`), routed by
  - V2 `topk_method` "greedy" / "group_limited_greedy": softmax scores, top-k within the
    `topk_group` groups of highest max score;
  - V3 "noaux_tc": sigmoid scores plus `e_score_correction_bias` for the choice only, groups
    ranked by their two best biased scores, weights renormalised (`norm_topk_prob`);
  both scaled by `routed_scaling_factor`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.kv_spec import MLASpec
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import VocabParallelEmbedding
from pagedserve.layers.mla import MLAttention
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.models.base import DecoderStack, KVCache, KVCacheSpec, PagedCausalLM
from pagedserve.models.llama import LlamaMLP


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale `0.1 * mscale * ln(factor) + 1` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(config: Any) -> float:
    """`qk_head_dim ** -0.5`, times `yarn_mscale(factor, mscale_all_dim) ** 2` when the rope
    is scaled and the config names `mscale_all_dim` (HF's `yarn_apply_mscale`: `yarn_mscale`)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_mscale(params["factor"], mscale_all_dim)
            scale = scale * m * m
    return scale


def is_moe_layer(config: Any, index: int) -> bool:
    """Whether layer `index` is a mixture-of-experts layer: "sparse" in the config's
    `mlp_layer_types` where it has that list (GLM-4.7-Flash's), otherwise past the first
    `first_k_dense_replace` layers and on the `moe_layer_freq` stride (vLLM's rule; HF's
    DeepSeek classes read only the first); never without routed experts."""
    if not getattr(config, "n_routed_experts", None):
        return False
    if (types := getattr(config, "mlp_layer_types", None)) is not None:
        return types[index] == "sparse"
    freq = getattr(config, "moe_layer_freq", 1) or 1
    return index >= (getattr(config, "first_k_dense_replace", 0) or 0) and index % freq == 0


def deepseek_routing(config: Any, *, v3: bool):
    """The router rules of a DeepSeek config (`layers.moe.MoERouting`): V2 softmax with its
    `topk_method` ("greedy" / "group_limited_greedy"), V3 sigmoid "noaux_tc" (unless the config
    names its own `scoring_func` / `topk_method`); the router weight and logits in float32 (HF
    keeps `gate.weight` in float32)."""
    from pagedserve.layers.moe import MoERouting

    return MoERouting.from_config(config, scoring="sigmoid" if v3 else "softmax",
                                  topk_method="noaux_tc" if v3 else "greedy", router_fp32=True)


def deepseek_moe(config: Any, *, v3: bool, tp: TPContext = SINGLE, expert_parallel: bool = False) -> nn.Module:
    """The mixture-of-experts feed-forward of a DeepSeek layer (`layers.moe.FusedMoE`): routed
    experts of `moe_intermediate_size` and `n_shared_experts` shared ones as one plain MLP beside
    them (checkpoint name `shared_experts`, ours `shared_expert`)."""
    from pagedserve.layers.moe import FusedMoE

    shared = int(getattr(config, "n_shared_experts", 0) or 0) * config.moe_intermediate_size
    return FusedMoE(config.hidden_size, config.moe_intermediate_size, int(config.n_routed_experts),
                    deepseek_routing(config, v3=v3), act=config.hidden_act,
                    shared_intermediate_size=shared, shared_act=config.hidden_act, tp=tp,
                    expert_parallel=expert_parallel)


class DeepseekV2DecoderLayer(nn.Module):
    """Pre-norm block: x + mla(norm(x)), then x + ffn(norm(x)) (dense MLP or MoE)."""

    def __init__(self, config: Any, index: int, *, v3: bool = False, expert_parallel: bool = False,
                 tp: TPContext = SINGLE):
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = MLAttention(
            config.hidden_size,
            config.num_attention_heads,
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            scale=mla_softmax_scale(config),
            rope_interleave=getattr(config, "rope_interleave", True),
            bias=getattr(config, "attention_bias", False),
            eps=eps,
            tp=tp,
        )
        if is_moe_layer(config, index):
            self.mlp = deepseek_moe(config, v3=v3, tp=tp, expert_parallel=expert_parallel)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                                getattr(config, "mlp_bias", False), tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:  # [T, H] -> [T, H]
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2Model(DecoderStack):
    """Embeddings, decoder layers and final norm (HF's `model.` submodule)."""

    def __init__(self, config: Any, *, v3: bool = False, expert_parallel: bool = False,
                 tp: TPContext = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(config, i, v3=v3, expert_parallel=expert_parallel, tp=tp)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, rope_parameters(config),
                                          config.max_position_embeddings)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary_emb(positions, x.dtype)  # 2 x [T, qk_rope]
        return x, [(rope,)] * len(self.layers)

    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.norm(x)


class DeepseekV2ForCausalLM(PagedCausalLM):
    """DeepSeek V2 / V2-Lite on a paged latent cache (see `pagedserve.models.base.CausalLM`);
    `tp` makes it this rank's shard. Its KV cache spec is `MLASpec(kv_lora_rank +
    qk_rope_head_dim)` on every layer: one latent row per token per layer, no V tensor
    (`layers.mla.latent_cache`; whole on every tensor-parallel rank)."""

    tied_by_default = False
    v3 = False  # V3's routing defaults (sigmoid, noaux_tc)

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.expert_parallel = bool(getattr(config, "enable_expert_parallel", False))
        self.model = DeepseekV2Model(config, v3=self.v3, expert_parallel=self.expert_parallel, tp=tp)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size, num_kv_heads=1,
                        head_dim=config.kv_lora_rank + config.qk_rope_head_dim, tp=tp)
        latent = config.kv_lora_rank + config.qk_rope_head_dim
        n = config.num_hidden_layers
        # NOTE: the cache allocates one `[blocks, block_size, 1, latent]` tensor per layer slot
        # and V None (worker/kv_cache.py); `MLAttention` reads only K (`latent_cache`).
        self.kv_cache_spec = KVCacheSpec(n, 1, latent, layers=(MLASpec(latent),) * n)
        self._placement = next((layer.mlp.placement for layer in self.model.layers
                                if hasattr(layer.mlp, "placement")), None)

    def backbone(self) -> nn.Module:
        return self.model

    def _rename(self, name: str) -> str | tuple | None:
        name = super()._rename(name.replace(".mlp.shared_experts.", ".mlp.shared_expert."))
        if name is None or self._placement is None:
            return name
        from pagedserve.layers.moe import expert_param_name

        return expert_param_name(name, self._placement)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek V3 (and R1): V2's architecture with sigmoid "noaux_tc" routing (`layers.moe`)
    and optionally non-interleaved RoPE (`rope_interleave`). Multi-token-prediction layers past
    `num_hidden_layers` in a checkpoint are skipped."""

    v3 = True

    def _rename(self, name: str) -> str | tuple | None:
        prefix = "model.layers."
        if name.startswith(prefix):
            index = int(name[len(prefix):].split(".", 1)[0])
            if index >= self.config.num_hidden_layers:
                return None  # a multi-token-prediction module (not used for decoding)
        return super()._rename(name)
