"""Normalization layers matching HF numerics (statistics in float32, cast back)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.platforms import OpsUser

LayerNorm = nn.LayerNorm  # GPT-2 / OPT use torch's LayerNorm as is.


class HeadLayerNorm(nn.LayerNorm):
    """torch's LayerNorm (weight and bias) over each head's features, one weight for every head
    (Phi's `qk_layernorm`); no fused q/k norm + RoPE kernel takes it (`kernel_args`: None)."""

    def kernel_args(self, dtype: torch.dtype) -> None:
        return None


class LayerNorm1P(nn.LayerNorm):
    """Nemotron's "layernorm1p": torch's LayerNorm (weight and bias) whose stored weight is an
    offset, `layer_norm(x) * (1 + weight) + bias` (HF's `NemotronLayerNorm1P`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return F.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


class WeightlessLayerNorm(nn.Module):
    """LayerNorm with neither weight nor bias, in float32, cast back (OLMo's `OlmoLayerNorm`;
    its eps is fixed, 1e-5)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.normalized_shape, self.eps = (hidden_size,), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        return F.layer_norm(x.float(), self.normalized_shape, None, None, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class RMSNorm(OpsUser, nn.Module):
    """Llama-style RMSNorm: `weight * (x / rms(x))`, normalized in float32 and cast back to the input
    dtype before the (model-dtype) weight multiplies it, as `LlamaRMSNorm` does (bf16: fused on
    the platform's ops where they take it, `LayerOps.rms_norm`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        if x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:
            y = self.ops.rms_norm(x, _weight_f32(self, lambda w: w.float()), self.eps, "llama")
            if y is not None:
                return y
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def kernel_args(self, dtype: torch.dtype) -> tuple[torch.Tensor, float, str] | None:
        """(fp32 weight, eps, numerics "llama") for fused kernels (q/k norm + RoPE, the fused
        decode layer) on `dtype` activations, or None where the eager formula is not the
        kernels' (not bf16)."""
        if dtype != torch.bfloat16 or self.weight.dtype != torch.bfloat16:
            return None
        return _weight_f32(self, lambda w: w.float()), self.eps, "llama"

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class WeightlessRMSNorm(nn.Module):
    """RMSNorm without a weight, `x / rms(x)` over the last dimension in float32, cast back
    (Llama 4's per-head "L2 norm" of q and k: HF's `Llama4TextWeightlessRMSNorm`)."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


class GemmaRMSNorm(OpsUser, nn.Module):
    """Gemma RMSNorm: the stored weight is an offset, `x / rms(x) * (1 + weight)`, all in float32,
    then cast to the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        w1 = _weight_f32(self, lambda w: 1.0 + w.float())  # [H] fp32
        if x.dtype == torch.bfloat16:
            y = self.ops.rms_norm(x, w1, self.eps, "gemma")
            if y is not None:
                return y
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * w1).to(x.dtype)

    def kernel_args(self, dtype: torch.dtype) -> tuple[torch.Tensor, float, str] | None:
        """(fp32 1 + weight, eps, numerics "gemma") for fused kernels on `dtype` activations,
        or None (not bf16)."""
        if dtype != torch.bfloat16:
            return None
        return _weight_f32(self, lambda w: 1.0 + w.float()), self.eps, "gemma"

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class Fp32WeightRMSNorm(OpsUser, nn.Module):
    """RMSNorm whose weight multiplies in float32 before the cast back: `(w * (x / rms(x)))`
    in float32, then the input dtype (HF's gpt-oss norm, whose weight stays float32). On bf16
    activations it runs the fused kernel with the "gemma" numerics (fp32 weight, one rounding)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H]
        w32 = _weight_f32(self, lambda w: w.float())  # [H] fp32
        if x.dtype == torch.bfloat16:
            y = self.ops.rms_norm(x, w32, self.eps, "gemma")
            if y is not None:
                return y
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * w32).to(x.dtype)

    def kernel_args(self, dtype: torch.dtype) -> tuple[torch.Tensor, float, str] | None:
        """(fp32 weight, eps, numerics "gemma") for fused kernels on `dtype` activations, or
        None (not bf16): the kernel `forward` runs on bf16 x."""
        if dtype != torch.bfloat16:
            return None
        return _weight_f32(self, lambda w: w.float()), self.eps, "gemma"

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def _weight_f32(norm: nn.Module, make) -> torch.Tensor:
    """`make(norm.weight)` (an fp32 [H] tensor), cached on the module until the weight changes.

    NOTE: keyed by the weight's storage and version counter, so loading weights (in place or by
    replacing the parameter) or moving the module invalidates it -- but writes through
    `weight.data` bypass the version counter: change weights under `torch.no_grad()` instead.
    """
    w = norm.weight
    key = (w.data_ptr(), w._version, w.dtype, w.device)
    cached = norm.__dict__.get("_w32")
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, make(w.detach()).contiguous())
        norm.__dict__["_w32"] = cached
    return cached[1]


def sharded_mean_square(x32: torch.Tensor, tp, full_size: int) -> torch.Tensor:  # [..., 1]
    """The mean of squares over the last dimension of float32 `x32` when that dimension is this
    rank's slice of `full_size` features split over `tp`'s ranks: the slices' sums of squares
    summed over the ranks (one all-reduce), over `full_size` (whole-projection q/k norms under
    tensor parallelism: OLMoE, OLMo 2)."""
    return tp.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / full_size


class GatedRMSNorm(nn.Module):
    """Mamba2's gated RMSNorm (HF's `MambaRMSNormGated` family: Bamba, Granite 4.0-H, Nemotron-H,
    Falcon-H1) over `hidden_size` features in groups of `group_size` (the RMS taken per group).

    `norm_before_gate=False` (Bamba, Granite, Nemotron-H): `weight * norm(x * silu(gate))`;
    True (Falcon-H1's option): `(weight * norm(x)) * silu(gate)`. In float32, cast back to x's
    dtype; silu on the platform's one-formula kernel (`layers.activation`: a token's bits must
    not depend on its batch)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-6, *,
                 norm_before_gate: bool = False, shared_group: tuple | None = None):
        super().__init__()
        if shared_group is None and (group_size <= 0 or hidden_size % group_size):
            raise ValueError(f"a gated RMSNorm's group size ({group_size}) must divide its width ({hidden_size})")
        from pagedserve.layers.activation import get_activation

        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size, self.eps, self.norm_before_gate = group_size, eps, norm_before_gate
        # (tp, g, G): the features are this rank's slice of group g of G, which other ranks
        # share (tensor parallelism with fewer groups than ranks); group_size is the whole group's
        self.shared_group = shared_group
        self.silu = get_activation("silu")

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [T, I] x 2 -> [T, I]
        dtype, shape = x.dtype, x.shape
        x32 = x.float()  # [T, I]
        gate32 = self.silu(gate.float().contiguous())  # [T, I]
        if not self.norm_before_gate:
            x32 = x32 * gate32
        if self.shared_group is not None:
            x32 = x32 * torch.rsqrt(self._shared_mean_square(x32) + self.eps)  # [T, I]
        else:
            groups = x32.view(*shape[:-1], -1, self.group_size)  # [T, G, I / G]
            groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
            x32 = groups.view(shape)  # [T, I]
        if self.norm_before_gate:
            return ((self.weight.float() * x32) * gate32).to(dtype)
        return self.weight * x32.to(dtype)

    def _shared_mean_square(self, x32: torch.Tensor) -> torch.Tensor:  # [T, I] -> [T, 1]
        """The mean of squares over this rank's group, whose slices the ranks sharing it hold:
        each rank's sum placed in its group's column, all-reduced, that column over the size."""
        tp, g, count = self.shared_group
        sums = x32.new_zeros(*x32.shape[:-1], count)  # [T, G]
        sums[..., g] = x32.pow(2).sum(-1)
        return (tp.all_reduce(sums)[..., g] / self.group_size).unsqueeze(-1)

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, group_size={self.group_size}, eps={self.eps}, "
                f"norm_before_gate={self.norm_before_gate}")
