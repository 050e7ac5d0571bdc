"""The recurrent layers' recurrences on CPU (csrc/recurrent_fp32.cpp, in the extension of
`kernels.cpu_fp32`): float32, one (sequence, head) at a time over its tokens in one fixed order,
so a token's bits do not depend on the chunking or the batch (the rule `layers.recurrent_state`
states).

- `gated_delta_rule(q, k, v, beta, decay, state, query_start_loc)`: Gated DeltaNet's
  `S *= decay; S += k^T ((v - k S) beta); out = q S` per token (Qwen3-Next, Qwen3.5).
- `kimi_delta_rule(q, k, v, beta, decay, state, query_start_loc)`: Kimi Delta Attention's, the
  same with `decay [T, H, K]`, one per key channel (row i of S times decay[t, h, i]; Kimi Linear).
- `ssm_scan(x, dt, A, B, C, D, state, query_start_loc)`: Mamba 2's
  `S = S exp(dt A) + dt x B^T; y = S C + D x` per token (Granite 4.0-H and kin).

Both update `state` `[S, H, ...]` in place (one row per sequence of the step, in the order of
`query_start_loc`) and return None where they do not apply (not float32 CPU tensors, the
extension disabled or unavailable): the caller then runs its torch loop, which is just as
batch-invariant, only slower. NOTE: a process uses one or the other for every step, so the
two never mix within a request.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_fp32 import _get_isa


def _usable(*tensors: torch.Tensor) -> bool:
    if any(t.dtype != torch.float32 or not t.is_cpu for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return _get_isa() is not None


def _as_paged(state: torch.Tensor):
    """A batch of states `[S, ...]` outside the cache as the paged kernels take them: one
    `[S, words]` tensor, sequence s in its row s, none fresh."""
    s = state.shape[0]
    rows = torch.arange(s, dtype=torch.int64, device=state.device)[None]  # [1, S]
    return [state.view(s, -1)], rows, torch.zeros(s, dtype=torch.bool, device=state.device)


def gated_delta_rule(
    q: torch.Tensor,  # [T, H, K]
    k: torch.Tensor,  # [T, H, K]
    v: torch.Tensor,  # [T, H, V]
    beta: torch.Tensor,  # [T, H]
    decay: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [S, H, K, V] float32, updated in place
    query_start_loc: torch.Tensor,  # [S + 1] int64
) -> torch.Tensor | None:  # [T, H, V]
    """See the module docstring (the state outside the cache: `gated_delta_rule_paged` on it)."""
    if not _usable(state) or not state.is_contiguous():
        return None
    caches, rows, fresh = _as_paged(state)
    return gated_delta_rule_paged(q, k, v, beta, decay, caches, rows, 0, fresh, query_start_loc)


def kimi_delta_rule(
    q: torch.Tensor,  # [T, H, K]
    k: torch.Tensor,  # [T, H, K]
    v: torch.Tensor,  # [T, H, V]
    beta: torch.Tensor,  # [T, H]
    decay: torch.Tensor,  # [T, H, K]
    state: torch.Tensor,  # [S, H, K, V] float32, updated in place
    query_start_loc: torch.Tensor,  # [S + 1] int64
) -> torch.Tensor | None:  # [T, H, V]
    """See the module docstring (the state outside the cache: `kimi_delta_rule_paged` on it)."""
    if not _usable(state) or not state.is_contiguous():
        return None
    caches, rows, fresh = _as_paged(state)
    return kimi_delta_rule_paged(q, k, v, beta, decay, caches, rows, 0, fresh, query_start_loc)


def ssm_scan(
    x: torch.Tensor,  # [T, H, P]
    dt: torch.Tensor,  # [T, H]
    A: torch.Tensor,  # [H] (negative)
    B: torch.Tensor,  # [T, G, N]
    C: torch.Tensor,  # [T, G, N]
    D: torch.Tensor,  # [H]
    state: torch.Tensor,  # [S, H, P, N] float32, updated in place
    query_start_loc: torch.Tensor,  # [S + 1] int64
) -> torch.Tensor | None:  # [T, H, P]
    """See the module docstring (the state outside the cache: `ssm_scan_paged` on it)."""
    if not _usable(state) or not state.is_contiguous():
        return None
    caches, rows, fresh = _as_paged(state)
    return ssm_scan_paged(x, dt, A, B, C, D, caches, rows, 0, fresh, query_start_loc)


def gather_state(caches: list[torch.Tensor], blocks: torch.Tensor, start: int, count: int,
                 fresh: torch.Tensor) -> torch.Tensor | None:  # [S, count] float32
    """Words `[start, start + count)` of each sequence's paged state (`layers.recurrent_state`:
    `caches` the K, V tensors of its entries in order, `blocks [E, S]` each entry's block of each
    sequence) as float32, zeros where `fresh [S]`; None without the kernels."""
    if _get_isa() is None or not all(t.is_cpu for t in caches):
        return None
    return torch.ops.pagedserve_fp32.paged_state_gather.default(
        caches, blocks.contiguous(), start, count, fresh)


def scatter_state(caches: list[torch.Tensor], blocks: torch.Tensor, start: int,
                  values: torch.Tensor) -> bool:
    """Store `values [S, count]` (float32) as words `[start, start + count)` of each sequence's
    paged state (see `gather_state`); False without the kernels (nothing written)."""
    if _get_isa() is None or not all(t.is_cpu for t in caches):
        return False
    torch.ops.pagedserve_fp32.paged_state_scatter.default(
        caches, blocks.contiguous(), start, values.float().contiguous())
    return True


def gated_delta_rule_paged(q, k, v, beta, decay, caches: list[torch.Tensor], blocks: torch.Tensor,
                           start: int, fresh: torch.Tensor,
                           query_start_loc: torch.Tensor) -> torch.Tensor | None:  # [T, H, V]
    """`gated_delta_rule` on a state kept in the cache (`gather_state`'s `caches`, `blocks`):
    head h's `[K, V]` at words `start + h K V` of each sequence's state, zeros where `fresh`,
    read and stored in place; None without the kernels."""
    if not _usable(q, k, v, beta, decay) or not all(t.is_cpu for t in caches):
        return None
    return torch.ops.pagedserve_fp32.fp32_gated_delta_rule_paged.default(
        q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(), decay.contiguous(),
        caches, blocks.contiguous(), start, fresh, query_start_loc.to(torch.int64), _get_isa())


def kimi_delta_rule_paged(q, k, v, beta, decay, caches: list[torch.Tensor], blocks: torch.Tensor,
                          start: int, fresh: torch.Tensor,
                          query_start_loc: torch.Tensor) -> torch.Tensor | None:  # [T, H, V]
    """`kimi_delta_rule` on a state kept in the cache (as `gated_delta_rule_paged`, the decay
    `[T, H, K]`: the kernel's per-key-channel variant); None without the kernels."""
    if decay.dim() != 3 or decay.shape != q.shape:
        raise ValueError(f"kimi_delta_rule_paged: decay {tuple(decay.shape)} must be q's [T, H, K] "
                         f"{tuple(q.shape)}")
    return gated_delta_rule_paged(q, k, v, beta, decay, caches, blocks, start, fresh, query_start_loc)


def ssm_scan_paged(x, dt, A, B, C, D, caches: list[torch.Tensor], blocks: torch.Tensor,
                   start: int, fresh: torch.Tensor,
                   query_start_loc: torch.Tensor) -> torch.Tensor | None:  # [T, H, P]
    """`ssm_scan` on a state kept in the cache: head h's `[P, N]` at words `start + h P N` of
    each sequence's state (see `gated_delta_rule_paged`); None without the kernels."""
    if not _usable(x, dt, A, B, C, D) or not all(t.is_cpu for t in caches):
        return None
    return torch.ops.pagedserve_fp32.fp32_ssm_scan_paged.default(
        x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(), C.contiguous(),
        D.contiguous(), caches, blocks.contiguous(), start, B.shape[-1], fresh,
        query_start_loc.to(torch.int64), _get_isa())
