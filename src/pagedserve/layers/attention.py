"""The attention op every model layer calls: per-head reshapes around paged attention."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata


class PagedAttention(nn.Module):
    """Causal attention of one layer over its paged KV cache (optionally sliding-window; with
    per-head attention sinks given at the call, as gpt-oss).

    Takes projected (and already rotated) q/k/v per head, writes k/v into the layer's cache and
    attends each query over its sequence's cached context, on the attention backend that built
    the step's metadata (`meta.impl`, chosen by the platform). `softcap` (Gemma 2's
    `attn_logit_softcapping`): each scaled score s becomes `softcap * tanh(s / softcap)`.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        *,
        softcap: float | None = None,
    ):
        super().__init__()
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        if softcap is not None and softcap <= 0:
            raise ValueError(f"attention softcap must be positive, got {softcap}")
        self.softcap = softcap

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [N + 1, B, Hkv, D]
        meta: AttentionMetadata,
        *,
        sinks: torch.Tensor | None = None,  # [Hq] learned sink logits (gpt-oss), or None
    ) -> torch.Tensor:  # [T, Hq * D]
        impl = meta.impl  # the backend that built the metadata
        if sinks is None:  # (backends without sinks keep their signature)
            out = impl.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window,
                               softcap=self.softcap)  # [T, Hq, D]
        else:
            out = impl.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window,
                               softcap=self.softcap, sinks=sinks)  # [T, Hq, D]
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, softcap={self.softcap}"
        )
