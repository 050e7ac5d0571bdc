"""The pure state-space LMs: Mamba (`MambaForCausalLM`, state-spaces/mamba-*-hf), Falcon Mamba
(`FalconMambaForCausalLM`) and Mamba2 (`Mamba2ForCausalLM`: Mamba-Codestral): no attention at
all, every layer `x + mixer(norm(x))`.

As HF 5.x:
- Mamba's mixer is `layers.mamba1` without dt / B / C norms, Falcon Mamba's the same with
  weightless RMSNorms on them (eps `mixer_rms_eps`), Mamba2's `layers.mamba2` (the gated
  RMSNorm over `n_groups` groups, eps `layer_norm_epsilon`);
- `residual_in_fp32`: the residual stream is float32 (each layer's norm reads it cast to the
  model dtype, the final norm's output is cast back before the LM head);
- the checkpoint's `backbone.embeddings`, `backbone.layers.{i}.mixer.*`, `backbone.norm_f` map
  onto our `model.embed_tokens`, `model.layers.{i}.mamba.*`, `model.norm`.

The cache: only a mixer's state entries per layer (`models.mamba_hybrid`). With no attention
layer to set the page shape, the states fit their own (`layers.recurrent_state.fitted_page`:
one KV "head" of half a page) and the KV spec declares it. Tensor parallelism splits the Mamba
channels / heads as in the hybrids.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import VocabParallelEmbedding
from pagedserve.layers.mamba1 import Mamba1Mixer
from pagedserve.layers.mamba2 import Mamba2Mixer
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.recurrent_state import KVPair
from pagedserve.models.mamba_hybrid import HybridCausalLM, HybridLayer, HybridStack


class MambaLayer(HybridLayer):
    """`x + mamba(norm(x))`; the norm reads `x` in the model dtype (`x` may be the float32
    residual stream)."""

    def __init__(self, hidden_size: int, eps: float, mixer: nn.Module):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.mamba = mixer

    def forward(self, x: torch.Tensor, caches: list[KVPair],
                metas: list[AttentionMetadata]) -> torch.Tensor:  # [T, H] -> [T, H]
        h = self.norm(x.to(self.norm.weight.dtype))  # [T, H]
        return x + self.mamba(h, caches, metas)


class MambaModel(HybridStack):
    """Embeddings, `MambaLayer`s, the final RMSNorm (`norm_f`); with `residual_in_fp32` the stream
    between them is float32."""

    def __init__(self, config: Any, mixers: list[nn.Module], tp: TPContext = SINGLE):
        super().__init__()
        eps = float(config.layer_norm_epsilon)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList([MambaLayer(config.hidden_size, eps, m) for m in mixers])
        self.norm = RMSNorm(config.hidden_size, eps)
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", True))

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        x = self.embed_tokens(input_ids)  # [T, H]
        return (x.float() if self.residual_in_fp32 else x), [()] * len(self.layers)

    def final(self, x: torch.Tensor) -> torch.Tensor:  # [T, H]
        # (HF: the weight times the float32 normalized stream, cast to the head's dtype)
        return self.norm(x).to(self.norm.weight.dtype)


class _PureStateLM(HybridCausalLM):
    """An LM over `MambaModel`: a subclass builds the mixers (`mixer(config, tp)`, page None);
    the KV spec is one state "head" of half the fitted page."""

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        super().__init__()
        mixers = [self.mixer(config, tp) for _ in range(config.num_hidden_layers)]
        self.model = MambaModel(config, mixers, tp)
        head_dim = mixers[0].state.page // 2 if mixers else 1
        self._init_head(config, self.model.embed_tokens, head_in=config.hidden_size, num_kv_heads=1,
                        head_dim=head_dim, tp=tp)
        self.init_cache(1, head_dim)

    @staticmethod
    def mixer(config: Any, tp: TPContext) -> nn.Module:
        raise NotImplementedError

    def _rename(self, name: str) -> str | tuple | None:
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        name = name.replace("model.embeddings.", "model.embed_tokens.").replace("model.norm_f.", "model.norm.")
        return super()._rename(name.replace(".mixer.", ".mamba."))


def _mamba1(config: Any, tp: TPContext, dt_bc_norm: str | None, eps: float) -> Mamba1Mixer:
    hidden = config.hidden_size
    dt_rank = config.time_step_rank
    if dt_rank in (None, "auto"):
        dt_rank = math.ceil(hidden / 16)
    return Mamba1Mixer(hidden, intermediate_size=int(config.intermediate_size),
                       state_size=int(config.state_size), dt_rank=int(dt_rank),
                       conv_kernel=int(config.conv_kernel), page=None,
                       conv_bias=bool(config.use_conv_bias), proj_bias=bool(config.use_bias),
                       activation=config.hidden_act, norm_eps=eps, dt_bc_norm=dt_bc_norm, tp=tp)


class MambaForCausalLM(_PureStateLM):
    """Mamba (1) decoder-only LM on a paged cache (see the module docstring)."""

    @staticmethod
    def mixer(config: Any, tp: TPContext) -> Mamba1Mixer:
        return _mamba1(config, tp, None, 1e-6)


class FalconMambaForCausalLM(_PureStateLM):
    """Falcon Mamba: Mamba (1) with weightless RMSNorms on dt, B and C (`mixer_rms_eps`)."""

    @staticmethod
    def mixer(config: Any, tp: TPContext) -> Mamba1Mixer:
        return _mamba1(config, tp, "weightless", float(config.mixer_rms_eps))


class Mamba2ForCausalLM(_PureStateLM):
    """Mamba2 decoder-only LM on a paged cache (see the module docstring)."""

    tied_by_default = False

    @staticmethod
    def mixer(config: Any, tp: TPContext) -> Mamba2Mixer:
        hidden, heads, head_dim = config.hidden_size, int(config.num_heads), int(config.head_dim)
        if heads * head_dim != int(config.expand * hidden):
            raise ValueError(f"config.num_heads ({heads}) x head_dim ({head_dim}) must equal expand x "
                             f"hidden_size ({config.expand} x {hidden})")
        return Mamba2Mixer(hidden, num_heads=heads, head_dim=head_dim, state_size=int(config.state_size),
                           n_groups=int(config.n_groups), conv_kernel=int(config.conv_kernel), page=None,
                           conv_bias=bool(config.use_conv_bias), proj_bias=bool(config.use_bias),
                           activation=config.hidden_act, norm_eps=float(config.layer_norm_epsilon),
                           time_step_limit=tuple(config.time_step_limit or (0.0, math.inf)), tp=tp)
