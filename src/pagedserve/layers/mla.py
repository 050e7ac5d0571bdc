"""Multi-head latent attention (MLA: DeepSeek V2 / V2-Lite / V3) over the paged KV cache.

Per token the cache holds one *latent* row of `kv_lora_rank + qk_rope_head_dim` values: the
compressed KV `c = kv_a_layernorm(kv_a(x)[:r])` and the shared rope key `k_pe` (rotated), side
by side -- not a K and a V per head. Attention runs in latent space, with the up-projection
`kv_b_proj` absorbed into the query and the output (as vLLM's MLA decode path):

    q_lat[h] = q_nope[h] @ W_uk[h]                 [r]       (W_uk[h]: [qk_nope, r])
    score[h, t] = (q_lat[h] . c_t + q_pe[h] . k_pe_t) * scale
    o_lat[h] = sum_t softmax(score[h])_t c_t       [r]
    out[h] = o_lat[h] @ W_uv[h]^T                  [v_head_dim]

which equals HF's `softmax([q_nope, q_pe] . [W_uk c, k_pe]) (W_uv c)`. It is multi-query
attention with one KV "head" of `r + rope` values whose value is the first `r` of them, so it
runs on the platform's attention backend unchanged (the latent passed as both K and V; the
output's last `rope` columns dropped).

NOTE: prompt tokens and decode rows take the same absorbed path, and every product goes through
the layer's `ops` (per head: batch-invariant on the CPU platform's float32 kernels), so a token's
bits never depend on whether it was computed in a prompt chunk, a decode step or a recomputation
after preemption -- the engine's exactness guarantees hold for MLA models too. Prompts pay the
absorbed path's larger attention width (r + rope per head instead of qk_nope + rope); a prompt
path that up-projects the latents would be faster for long prompts but not bit-equal to decode.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.distributed.tp import SINGLE, TPContext
from pagedserve.layers.linear import ColumnParallelLinear, RowParallelLinear, ShardSpec, set_shard
from pagedserve.layers.norms import RMSNorm
from pagedserve.layers.rotary import apply_rotary
from pagedserve.platforms import OpsUser

# The attention kernels take at most this many query heads per KV head (the batch-invariant
# float32 kernel: 64); MLA's one latent "head" serves every query head, so wider models attend
# in slices of heads.
MAX_HEADS_PER_CALL = 64


def latent_cache(kv_cache: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """The layer's latent cache `[N + 1, B, 1, r + rope]` out of the pair the runner passes.

    NOTE: the one place MLA reads its cache. An MLA model declares `MLASpec(r + rope)` on every
    layer (models/deepseek_v2.py), so the KV cache allocates one tensor per layer slot and passes
    `(latent, None)`: no V tensor (worker/kv_cache.py). The attention backend still gets the
    latent as both K and V cache (its value is the latent's first r values, `_attend`)."""
    return kv_cache[0]


def rotate_interleaved(
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hk, D]
    cos: torch.Tensor,  # [T, D] (the two halves equal: cat(freqs, freqs))
    sin: torch.Tensor,  # [T, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on interleaved pairs `(x0, x1), (x2, x3), ...` (DeepSeek's layout, GPT-J style),
    returned de-interleaved (`[even rotated, odd rotated]`), as HF's DeepSeek V3 does: q and k
    alike, so their dot products are those of the interleaved rotation (HF's DeepSeek V2)."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # [T, 1, D/2]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, H, D/2]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    return rot(query), rot(key)


class LatentUpProjection(nn.Module):
    """`kv_b_proj`: the latent's up-projection `[H * (qk_nope + v_head_dim), r]` (this rank's
    heads), never applied as a layer -- `MLAttention` splits it per head into the absorbed
    `W_uk` / `W_uv`. NOTE: not a linear layer class on purpose, so a GGUF's quantized blocks for
    it are dequantized at load (`layers.quantization.can_quantize`) rather than kept."""

    def __init__(self, in_features: int, out_features: int, *, tp: TPContext = SINGLE):
        super().__init__()
        local = tp.split(out_features, "kv_b_proj output features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        if tp.is_parallel:
            start = tp.rank * local
            set_shard(self.weight, ShardSpec(0, ((start, start + local),), out_features))


class MLAttention(OpsUser, nn.Module):
    """DeepSeek's multi-head latent attention (module and parameter names as HF's
    `DeepseekV2Attention` / `DeepseekV3Attention`, so checkpoints load by name).

    `q_lora_rank` None: one `q_proj` (V2-Lite), else `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`.
    `rope_interleave`: RoPE on interleaved pairs (DeepSeek V2 always, V3 by default), else the
    rotate-half layout. `scale` is the softmax scale (`qk_head_dim ** -0.5`, times YaRN's
    mscale squared where the config asks). Under tensor parallelism each rank holds
    `num_heads / N` heads (q_b / kv_b column-parallel, o row-parallel); the latent projection
    and the latent cache are whole on every rank.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        rope_interleave: bool = True,
        bias: bool = False,
        eps: float = 1e-6,
        tp: TPContext = SINGLE,
    ):
        super().__init__()
        for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", qk_rope_head_dim),
                            ("v_head_dim", v_head_dim)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {qk_rope_head_dim}")
        self.num_heads = tp.split(num_heads, "num_attention_heads")
        self.kv_lora_rank, self.qk_nope_head_dim = kv_lora_rank, qk_nope_head_dim
        self.qk_rope_head_dim, self.v_head_dim = qk_rope_head_dim, v_head_dim
        self.scale, self.rope_interleave = scale, rope_interleave
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        whole = (0, 1)  # not sharded: every rank computes the latent
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden_size, num_heads * qk_head_dim, False, tp=tp)
        else:
            self.q_a_proj = ColumnParallelLinear(hidden_size, q_lora_rank, bias, tp=tp, part=whole)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, num_heads * qk_head_dim, False, tp=tp)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden_size, kv_lora_rank + qk_rope_head_dim,
                                                       bias, tp=tp, part=whole)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = LatentUpProjection(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim),
                                            tp=tp)
        self.o_proj = RowParallelLinear(num_heads * v_head_dim, hidden_size, bias, tp=tp)

    @property
    def latent_dim(self) -> int:
        """Values cached per token: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(W_uk^T [H, r, qk_nope], W_uv [H, v_head_dim, r])` out of `kv_b_proj` (this rank's
        heads), contiguous per head for `ops.linear`, in the activation dtype.

        NOTE: cached until `kv_b_proj.weight` changes (keyed by its storage and version counter,
        as the norms' fp32 weights)."""
        w = self.kv_b_proj.weight
        key = (w.data_ptr(), w._version, w.dtype)
        cached = self.__dict__.get("_absorbed")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                h, dn, r = self.num_heads, self.qk_nope_head_dim, self.kv_lora_rank
                per_head = w.detach().view(h, dn + self.v_head_dim, r)  # [H, dn + dv, r]
                w_uk_t = per_head[:, :dn, :].transpose(1, 2).contiguous()  # [H, r, dn]
                w_uv = per_head[:, dn:, :].contiguous()  # [H, dv, r]
            cached = (key, (w_uk_t, w_uv))
            self.__dict__["_absorbed"] = cached
        return cached[1]

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, rope]
        kv_cache: tuple[torch.Tensor, torch.Tensor | None],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        t, h = x.shape[0], self.num_heads
        dn, dr, r = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(x)  # [T, Hq * (dn + dr)]
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, h, dn + dr)  # [T, Hq, dn + dr]
        q_nope, q_pe = q[..., :dn], q[..., dn:]  # [T, Hq, dn], [T, Hq, dr]
        kv = self.kv_a_proj_with_mqa(x)  # [T, r + dr]
        c = self.kv_a_layernorm(kv[:, :r])  # [T, r]
        k_pe = kv[:, None, r:]  # [T, 1, dr]
        rotate = rotate_interleaved if self.rope_interleave else apply_rotary
        q_pe, k_pe = rotate(q_pe, k_pe, *rope)  # [T, Hq, dr], [T, 1, dr]
        latent = torch.cat((c, k_pe[:, 0]), dim=-1)  # [T, r + dr]

        w_uk_t, w_uv = self.absorbed_weights()
        q_lat = self._per_head(q_nope, w_uk_t)  # [T, Hq, r]
        query = torch.cat((q_lat.to(q_pe.dtype), q_pe), dim=-1)  # [T, Hq, r + dr]
        o_lat = self._attend(query, latent, kv_cache, meta)  # [T, Hq, r]
        out = self._per_head(o_lat, w_uv)  # [T, Hq, v_head_dim]
        return self.o_proj(out.reshape(t, h * self.v_head_dim))  # [T, H]

    def _per_head(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # [T, Hq, K] -> [T, Hq, N]
        """`linear(x[:, i], w[i])` for every head i: in one call where the platform has one
        (bit-identical to the loop), else the loop."""
        y = self.ops.linear_heads(x, w)
        if y is None:
            y = torch.stack([self.ops.linear(x[:, i], w[i]) for i in range(x.shape[1])], dim=1)
        return y

    def _attend(
        self,
        query: torch.Tensor,  # [T, Hq, r + dr]
        latent: torch.Tensor,  # [T, r + dr]
        kv_cache: tuple[torch.Tensor, torch.Tensor | None],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, Hq, r]
        """Write each new token's latent at its slot, then attend every query over its context's
        latents: multi-query attention with the latent as key and (its first r values) value."""
        cache = latent_cache(kv_cache)  # [N + 1, B, 1, r + dr]
        impl = meta.impl  # the backend that built the metadata
        kv = latent.unsqueeze(1)  # [T, 1, r + dr]
        outs = []
        # NOTE: each slice writes the same latents at the same slots again (idempotent).
        for start in range(0, query.shape[1], MAX_HEADS_PER_CALL):
            q = query[:, start : start + MAX_HEADS_PER_CALL]
            o = impl.forward(q, kv, kv, (cache, cache), meta, self.scale, None)  # [T, h, r + dr]
            outs.append(o[..., : self.kv_lora_rank])
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
                f"qk_nope={self.qk_nope_head_dim}, qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}, "
                f"scale={self.scale:.4g}, interleave={self.rope_interleave}")

