"""Rotary position embeddings (RoPE): every rope scaling HF configs carry, both layouts.

Frequencies follow `transformers.modeling_rope_utils` exactly (the same float32 arithmetic), for
the rope types "default", "linear", "dynamic" (NTK), "llama3" (Llama 3.1), "yarn" (with
`truncate`, `mscale` / `mscale_all_dim`, `attention_factor`) and "longrope" (Phi-3: short / long
factors, its attention factor; Phi-3.5-MoE's `short_mscale` / `long_mscale`), over the whole head
or its first `partial_rotary_factor` part; "proportional" (Gemma 4's full-attention layers) over
the whole head, its last frequencies zero (see `_proportional_inv_freq`).
cos/sin are computed per step from the token positions in float32, multiplied by the type's
attention factor, then cast to the activation dtype, as HF does. A type or option we do not
implement is a ValueError naming it (`check_rope_parameters`).

Layouts: "rotate half" (HF / GPT-NeoX: dimension i pairs with i + R/2) by default; interleaved
pairs (GPT-J / GLM: 2i with 2i + 1) with `interleaved=True`. Dimensions past the rotary part pass
through unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.platforms import DEFAULT_OPS

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional")

_COMMON_OPTIONS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "original_max_position_embeddings"}
# The options each rope type reads (HF's `_validate_*_rope_parameters`: required + optional).
_OPTIONS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor"},
    "yarn": {"factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
    "longrope": {"factor", "attention_factor", "short_factor", "long_factor", "short_mscale", "long_mscale"},
    "proportional": {"factor"},
}
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
# Types whose `original_max_position_embeddings` HF fills in (standardize_rope_params)
_ORIGINAL_MAX_TYPES = ("llama3", "yarn", "longrope")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict:
    """The RoPE parameters of `config` as one flat dict with at least `rope_type` and `rope_theta`.

    Reads transformers 5 `config.rope_parameters` (one dict, or one dict per layer type when
    `layer_type` is given and the dict is nested), falling back to the transformers 4 attributes
    `rope_theta` / `rope_scaling` (whose legacy key `type` means `rope_type`). As HF's
    `standardize_rope_params`: a `config.partial_rotary_factor` is the default of the dict's, and
    llama3 / yarn / longrope take `original_max_position_embeddings` from the config's attribute
    when it has one (Phi-3), else default it to `max_position_embeddings`.
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    nested = layer_type is not None and isinstance(params.get(layer_type), dict)
    if nested:
        params = dict(params[layer_type])
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    if params["rope_type"] in _ORIGINAL_MAX_TYPES:
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None and not nested:
            params["original_max_position_embeddings"] = original
        elif getattr(config, "max_position_embeddings", None) is not None:
            params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def check_rope_parameters(params: dict) -> None:
    """ValueError naming the rope type, or the first option of it, that we do not implement (or a
    required option that is missing)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    allowed = _COMMON_OPTIONS | _OPTIONS[rope_type]
    for key, value in params.items():
        if key in allowed or (key == "factor" and rope_type == "default" and value in (None, 1, 1.0)):
            continue
        raise ValueError(
            f"rope_parameters option {key!r} is not supported for rope_type {rope_type!r}; "
            f"supported options: {', '.join(sorted(allowed - {'type'}))}"
        )
    for key in _REQUIRED.get(rope_type, ()):
        if params.get(key) is None:
            raise ValueError(f"rope_type {rope_type!r} needs rope_parameters option {key!r}")


def rotary_dim(params: dict, head_dim: int) -> int:
    """How many leading dimensions of each head RoPE rotates: `int(head_dim * partial_rotary_factor)`
    (HF's rule); ValueError unless it is even and positive."""
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if dim <= 0 or dim % 2 or dim > head_dim:
        raise ValueError(
            f"RoPE needs an even rotary dimension in (0, head_dim]: head_dim {head_dim} x "
            f"partial_rotary_factor {params.get('partial_rotary_factor', 1.0)} = {dim}"
        )
    return dim


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:  # [dim // 2] fp32
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (base**exponent)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 for scale <= 1), as HF's."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(params: dict, scale: float) -> float:
    """The softmax scale DeepSeek V2 / V3 attention uses: `scale * m * m` with
    `m = yarn_get_mscale(factor, mscale_all_dim)` when the rope type is not "default" and
    `mscale_all_dim` is set, else `scale` (HF's `yarn_apply_mscale`, same order of products)."""
    if params.get("rope_type", "default") != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_get_mscale(params["factor"], mscale_all_dim)
            scale = scale * m * m
    return scale


def compute_inv_freq(
    params: dict, head_dim: int, max_position_embeddings: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[rotary_dim // 2]` (float32, CPU) and the cos/sin scaling factor for
    the rope `params` (see `rope_parameters`), as HF's `ROPE_INIT_FUNCTIONS[type](config, None,
    seq_len)`. `seq_len` matters for "dynamic" (its base grows past `max_position_embeddings`) and
    "longrope" (the long factors past `original_max_position_embeddings`)."""
    check_rope_parameters(params)
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    if rope_type == "proportional":
        return _proportional_inv_freq(params, base, head_dim), 1.0
    dim = rotary_dim(params, head_dim)
    if rope_type == "default":
        return _base_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _base_inv_freq(base, dim) / params["factor"], 1.0
    if rope_type == "dynamic":
        factor = params["factor"]
        seq_len = max(seq_len or max_position_embeddings, max_position_embeddings)
        base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    original_max = params.get("original_max_position_embeddings") or max_position_embeddings
    if rope_type == "llama3":
        return _llama3_inv_freq(params, base, dim, original_max), 1.0
    if rope_type == "longrope":
        return _longrope_inv_freq(params, base, dim, max_position_embeddings, original_max, seq_len)
    return _yarn_inv_freq(params, base, dim, max_position_embeddings, original_max)


def _proportional_inv_freq(params: dict, base: float, head_dim: int) -> torch.Tensor:  # [D / 2]
    """HF's "proportional" RoPE (Gemma 4): the first `int(partial_rotary_factor * head_dim // 2)`
    frequencies `base ** (-2i / head_dim)` (the exponent over the whole head, not the rotated
    part), the rest zero (cos 1, sin 0: those dimension pairs pass unchanged), all over
    `factor`. The table spans the whole head in the rotate-half layout, so the rotated pairs are
    (i, i + D/2) for the first frequencies -- not the first R dimensions of partial RoPE."""
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exponent = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponent)
    nope = head_dim // 2 - angles
    if nope > 0:
        inv_freq = torch.cat((inv_freq, torch.zeros(nope, dtype=torch.float32, device="cpu")))
    return inv_freq / params.get("factor", 1.0)


def _llama3_inv_freq(params: dict, base: float, dim: int, old_context_len: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(base, dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _longrope_inv_freq(params: dict, base: float, dim: int, max_position_embeddings: int,
                       original_max: int, seq_len: int | None) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    use_long = bool(seq_len and seq_len > original_max)
    mscales = [params.get(k) for k in ("short_mscale", "long_mscale")]
    if any(m is not None for m in mscales):  # Phi-3.5-MoE: the chosen set's factor replaces it
        if None in mscales:
            missing = "short_mscale" if mscales[0] is None else "long_mscale"
            raise ValueError(f"rope_parameters has one of short_mscale / long_mscale but no {missing}")
        attention_factor = mscales[1] if use_long else mscales[0]
    ext = params["long_factor"] if use_long else params["short_factor"]
    if len(ext) != dim // 2:
        which = "long_factor" if use_long else "short_factor"
        raise ValueError(f"rope_parameters {which} has {len(ext)} entries for a rotary dimension of {dim}")
    ext_factors = torch.tensor(ext, dtype=torch.float32, device="cpu")  # [dim // 2]
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (ext_factors * base**shape), float(attention_factor)


def _yarn_inv_freq(params: dict, base: float, dim: int, max_position_embeddings: int,
                   original_max: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [-x2, x1] for the two halves x1, x2 of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> (-x1, x0, -x3, x2, ...): the interleaved layout's rotation (GLM's `rotate_half`)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, R], R <= D
    sin: torch.Tensor,  # [T, R]
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first R dimensions of the query and key heads by the per-token angles whose
    cos/sin are given (R = D: the whole head), in the rotate-half layout or `interleaved` pairs
    (whose cos/sin `RotaryEmbedding(interleaved=True)` gives); the rest pass through."""
    rotate = rotate_pairs if interleaved else rotate_half
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, R]
    r = cos.shape[-1]
    if r == query.shape[-1]:
        return query * cos + rotate(query) * sin, key * cos + rotate(key) * sin
    q_rot, q_pass = query[..., :r], query[..., r:]  # [T, Hq, R], [T, Hq, D - R]
    k_rot, k_pass = key[..., :r], key[..., r:]
    query = torch.cat((q_rot * cos + rotate(q_rot) * sin, q_pass), dim=-1)  # [T, Hq, D]
    key = torch.cat((k_rot * cos + rotate(k_rot) * sin, k_pass), dim=-1)  # [T, Hkv, D]
    return query, key


def norm_and_rotate(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, R]
    sin: torch.Tensor,  # [T, R]
    q_norm: nn.Module | None = None,
    k_norm: nn.Module | None = None,
    ops=DEFAULT_OPS,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head `q_norm`/`k_norm` (both or neither; RMSNorm or GemmaRMSNorm), then RoPE.

    Where the platform's `ops` take it (the CPU's, on bf16 CPU activations, rotate-half over the
    whole head) one fused kernel does it all, in place on `query` and `key` (they must be fresh
    projection outputs nothing else reads); elsewhere the eager modules and `apply_rotary`, with
    the same result (see `kernels.cpu_rotary`). NOTE: the kernel rotates whole heads in halves:
    partial (R < D) and `interleaved` RoPE never reach it (it also refuses cos of another width).
    """
    if interleaved or cos.shape[-1] != query.shape[-1]:
        fused = False
    elif q_norm is None:
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
    return apply_rotary(query, key, cos, sin, interleaved)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of RoPE for the positions of one step (shared by all layers that use the same
    rope parameters); `apply_rotary` rotates q/k with them. The tables are `[T, R]` for the
    rotary dimension R (`rotary_dim`), in the rotate-half layout (`cat(f, f)`) or, `interleaved`,
    in pairs (`f0, f0, f1, f1, ...`: GLM's `repeat_interleave` of the first half).

    Length-dependent types:
    - "longrope": one set of factors for the whole model, chosen by the longest context it
      serves (`set_max_model_len`; until then `max_position_embeddings`): the long factors when
      that exceeds `original_max_position_embeddings`, else the short ones -- vLLM's rule (and
      llama.cpp's, by its context size). NOTE: HF picks by the current sequence length and, in
      `generate`, recomputes the whole cache with the long factors when a sequence crosses the
      original length; a paged cache cannot, and mixing the two sets in one sequence is what
      HF's comment calls a failure. So our logits equal HF's for sequences on the chosen side:
      `max_model_len <= original_max_position_embeddings` (short), or sequences longer than it
      (long). With `short_mscale` / `long_mscale` (Phi-3.5-MoE) the cos/sin factor is the chosen
      set's. NOTE: HF 5.x's Phi-3.5-MoE rotary applies the long mscale past the original length
      but keeps the *short* factors there (its forward recomputes `inv_freq` without the
      sequence length); Microsoft's code and vLLM take the long factors with it, as we do.
    - "dynamic": the NTK base for p + 1 for a token at position p >= max_position_embeddings, per
      token (HF's for a decode step at p; the engine keeps positions below that limit anyway).
    NOTE: every token's cos/sin depend on its own position only, never on the batch, the chunking
    or the prompt it came in (chunked prefill, prefix caching and preemption stay exact).
    """

    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int, *, interleaved: bool = False):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.params = dict(params)
        self.max_position_embeddings = max_position_embeddings
        self.interleaved = interleaved
        inv_freq, self.attention_scaling = compute_inv_freq(self.params, head_dim, max_position_embeddings)
        self.rotary_dim = 2 * inv_freq.numel()
        self.inv_freq = nn.Buffer(inv_freq.to(torch.get_default_device()), persistent=False)  # [R/2] fp32
        self.rope_type = self.params["rope_type"]
        self.uses_long_factors = False  # longrope: which set `inv_freq` holds
        if self.rope_type == "longrope":
            self.set_max_model_len(max_position_embeddings)

    def set_max_model_len(self, max_model_len: int) -> None:
        """The longest context the model serves (the engine's `max_model_len`): for "longrope",
        the long factors when it exceeds `original_max_position_embeddings`, else the short
        ones; no effect on the other types."""
        if self.rope_type != "longrope":
            return
        original = int(self.params.get("original_max_position_embeddings") or self.max_position_embeddings)
        self.uses_long_factors = max_model_len > original
        seq_len = original + 1 if self.uses_long_factors else None
        # (the cos/sin factor follows the set where the config has one per set: Phi-3.5-MoE's)
        inv_freq, self.attention_scaling = compute_inv_freq(self.params, self.head_dim,
                                                            self.max_position_embeddings, seq_len)
        self.inv_freq = nn.Buffer(inv_freq.to(self.inv_freq.device), persistent=False)  # [R/2] fp32

    def _freqs(self, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T, R/2] fp32
        pos = positions.float().unsqueeze(-1)  # [T, 1]
        freqs = pos * self.inv_freq.to(positions.device, torch.float32)  # [T, R/2]
        if self.rope_type == "dynamic" and positions.numel() and int(positions.max()) >= self.max_position_embeddings:
            freqs = freqs.clone()
            grown = (positions >= self.max_position_embeddings).nonzero().flatten().tolist()
            for i in grown:  # rare: the engine keeps positions below max_position_embeddings
                seq_len = int(positions[i]) + 1
                inv, _ = compute_inv_freq(self.params, self.head_dim, self.max_position_embeddings, seq_len)
                freqs[i] = pos[i] * inv.to(positions.device)
        return freqs

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[T, R]` for `positions [T]`, computed in float32 and cast to `dtype`."""
        freqs = self._freqs(positions)  # [T, R/2]
        if self.interleaved:
            emb = freqs.repeat_interleave(2, dim=-1)  # [T, R]
        else:
            emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
        cos = emb.cos() * self.attention_scaling  # [T, R]
        sin = emb.sin() * self.attention_scaling  # [T, R]
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, rope_type={self.rope_type}, "
                f"theta={self.params['rope_theta']}, interleaved={self.interleaved}")
