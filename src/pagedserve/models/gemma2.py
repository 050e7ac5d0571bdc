"""Gemma 2 (`Gemma2ForCausalLM`): Gemma 3's layer without q/k norms, with soft-capped scores.

Differences from Llama, as in HF 5.x (the rest is Gemma 3's, whose pieces this reuses):
- embeddings multiplied by sqrt(hidden_size) cast to the model dtype;
- Gemma RMSNorm (`x * (1 + w)`), four per layer (input, post-attention, pre- and post-feedforward);
- attention scale `query_pre_attn_scalar ** -0.5` and attention logit soft-capping
  (`attn_logit_softcapping`: `cap * tanh(s / cap)` on the scaled scores, an option of the
  attention call, `layers.attention.PagedAttention`);
- `layer_types` alternate sliding-window and global layers (HF's default: even layers slide),
  all with one RoPE;
- gelu_pytorch_tanh gated MLP, tied LM head, `final_logit_softcapping` on the logits.
NOTE: the fused decode layer does not cap scores: Gemma 2 layers run their modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import VocabParallelEmbedding
from pagedserve.layers.norms import GemmaRMSNorm
from pagedserve.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.models.base import DecoderStack, PagedCausalLM
from pagedserve.models.gemma3 import SLIDING, Gemma3DecoderLayer


def gemma2_layer_types(config: Any) -> list[str]:
    """`config.layer_types`, or (older configs) every other layer sliding, starting with the
    first (HF's `Gemma2Config` default)."""
    types = getattr(config, "layer_types", None)
    if types is None:
        types = [SLIDING if (i + 1) % 2 else "full_attention" for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"config.layer_types has {len(types)} entries for {config.num_hidden_layers} layers")
    return list(types)


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    """Gemma 3's sandwich-norm layer (its `unfused` math and norms), without q/k norms and with
    soft-capped attention scores."""

    def __init__(self, config: Any, sliding_window: int | None, *, tp: TPContext = SINGLE):
        super().__init__(config, sliding_window, tp=tp, qk_norm=False,
                         softcap=getattr(config, "attn_logit_softcapping", None))


class Gemma2Model(DecoderStack):
    """Scaled embeddings, decoder layers, final norm (HF's `model.`)."""

    layer_class: type = Gemma2DecoderLayer  # (VaultGemma's: models/vaultgemma.py)

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma2 with use_bidirectional_attention (embedding models) is not supported")
        self.layer_types = gemma2_layer_types(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.embed_scale = nn.Buffer(torch.tensor(config.hidden_size**0.5, dtype=torch.float32), persistent=False)
        self.layers = nn.ModuleList(
            self.layer_class(config, config.sliding_window if t == SLIDING else None, tp=tp)
            for t in self.layer_types
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, rope_parameters(config), config.max_position_embeddings)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        x = x * self.embed_scale.to(x.dtype)  # [T, H]; sqrt(hidden) rounded to the dtype, as HF
        rope = self.rotary_emb(positions, x.dtype)  # 2 x [T, D]
        return x, [(rope,)] * len(self.layers)

    def decoder_layers(self) -> nn.ModuleList:
        return self.layers

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        return self.norm(x)


class Gemma2ForCausalLM(PagedCausalLM):
    """Gemma 2 LM on a paged KV cache (see `pagedserve.models.base.CausalLM`); `tp` makes it this
    rank's shard."""

    model_class: type = Gemma2Model

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        self.model = self.model_class(config, tp=tp)
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, tp=tp)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def backbone(self) -> nn.Module:
        return self.model

    def final_softcap(self) -> float | None:
        return self.final_logit_softcapping
