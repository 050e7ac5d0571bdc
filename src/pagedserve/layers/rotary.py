"""Rotary position embeddings (RoPE) in the HF / GPT-NeoX "rotate half" layout.

Frequencies follow `transformers.modeling_rope_utils` exactly (same float32 arithmetic), for the
rope types "default", "linear", "dynamic" (NTK), "llama3" (Llama 3.1) and "yarn". cos/sin are
computed per step from the token positions in float32, then cast to the activation dtype, as HF does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.platforms import DEFAULT_OPS

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict:
    """The RoPE parameters of `config` as one flat dict with at least `rope_type` and `rope_theta`.

    Reads transformers 5 `config.rope_parameters` (one dict, or one dict per layer type when
    `layer_type` is given and the dict is nested), falling back to the transformers 4 attributes
    `rope_theta` / `rope_scaling` (whose legacy key `type` means `rope_type`).
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:  # [dim // 2] fp32
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (base**exponent)


def compute_inv_freq(
    params: dict, head_dim: int, max_position_embeddings: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim // 2]` (float32, CPU) and the cos/sin scaling factor for the
    rope `params` (see `rope_parameters`). `seq_len` only matters for "dynamic"."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    base = float(params["rope_theta"])
    dim = head_dim
    if rope_type == "default":
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, dim) / params["factor"], 1.0
    if rope_type == "dynamic":
        factor = params["factor"]
        seq_len = max(seq_len or max_position_embeddings, max_position_embeddings)
        base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "llama3":
        inv_freq = _base_inv_freq(base, dim)
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params.get("original_max_position_embeddings") or max_position_embeddings
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama), 1.0
    # yarn
    original_max = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original_max

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [-x2, x1] for the two halves x1, x2 of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key heads by the per-token angles whose cos/sin are given."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
    query = query * cos + rotate_half(query) * sin  # [T, Hq, D]
    key = key * cos + rotate_half(key) * sin  # [T, Hkv, D]
    return query, key


def norm_and_rotate(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    q_norm: nn.Module | None = None,
    k_norm: nn.Module | None = None,
    ops=DEFAULT_OPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head `q_norm`/`k_norm` (both or neither; RMSNorm or GemmaRMSNorm), then RoPE.

    Where the platform's `ops` take it (the CPU's, on bf16 CPU activations) one fused kernel does
    it all, in place on `query` and `key` (they must be fresh projection outputs nothing else
    reads); elsewhere the eager modules and `apply_rotary`, with the same result (see
    `kernels.cpu_rotary`).
    """
    if q_norm is None:
        fused = ops.qk_norm_rope_(query, key, cos, sin, None, None, 0.0, None)
    else:
        q_args, k_args = q_norm.kernel_args(query.dtype), k_norm.kernel_args(key.dtype)
        fused = (
            q_args is not None
            and k_args is not None
            and q_args[1:] == k_args[1:]
            and ops.qk_norm_rope_(query, key, cos, sin, q_args[0], k_args[0], q_args[1], q_args[2])
        )
    if fused:
        return query, key
    if q_norm is not None:
        query, key = q_norm(query), k_norm(key)
    return apply_rotary(query, key, cos, sin)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of RoPE for the positions of one step (shared by all layers that use the same
    rope parameters); `apply_rotary` rotates q/k with them.

    "dynamic" RoPE recomputes its frequencies per step from the largest position in the batch
    (`max(positions) + 1`), which is what HF does for a single sequence; it does not keep HF's
    grow-only cache between calls.
    """

    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.params = dict(params)
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_scaling = compute_inv_freq(self.params, head_dim, max_position_embeddings)
        self.inv_freq = nn.Buffer(inv_freq.to(torch.get_default_device()), persistent=False)  # [D/2] fp32
        self.is_dynamic = self.params["rope_type"] == "dynamic"

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, D]` for `positions [T]`, computed in float32 and cast to `dtype`."""
        inv_freq = self.inv_freq
        if self.is_dynamic and positions.numel():
            seq_len = int(positions.max()) + 1
            if seq_len > self.max_position_embeddings:
                inv_freq, _ = compute_inv_freq(self.params, self.head_dim, self.max_position_embeddings, seq_len)
        freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device, torch.float32)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = emb.cos() * self.attention_scaling  # [T, D]
        sin = emb.sin() * self.attention_scaling  # [T, D]
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rope_type={self.params['rope_type']}, theta={self.params['rope_theta']}"
