"""Random sampling of one token per row of fp32 logits on CPU, and logprobs without a log-softmax
of the whole vocabulary (csrc/sampling.cpp, part of the extension of kernels.cpu_gemm).

`sample_rows(logits, temperature, top_k, top_p, min_p, u)` applies each row's temperature, top-k,
top-p and min-p and draws by inverse CDF with the row's uniform `u` -- the rule of the torch path
in `worker.sampler` (`_sample_row`), which draws the same `u` -- and returns the token ids, or None
when the kernel does not apply (not a float32 CPU matrix, the kernel disabled or unavailable): the
caller then runs the torch path. Instead of torch's `multinomial` over the whole row and a full
sort for top-p, the kernel reads the row three times and sorts only the few hundred candidates
near the maximum.

`logprob_rows(logits, targets, k)` returns each row's raw logprob and rank of its target token and
its k largest logprobs, as `log_softmax` + `topk` would, or None (same conditions).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.kernels.cpu_gemm import sampling_kernel_available


def sample_rows(
    logits: torch.Tensor,  # [R, V] float32
    temperature: Sequence[float],  # [R] > 0
    top_k: Sequence[int],  # [R] 0: off
    top_p: Sequence[float],  # [R] in (0, 1]; 1: off
    min_p: Sequence[float],  # [R] in [0, 1]; 0: off
    u: Sequence[float],  # [R] uniform draws in [0, 1)
) -> torch.Tensor | None:  # [R] int64
    """See the module docstring."""
    if logits.dim() != 2 or logits.dtype is not torch.float32 or not logits.is_cpu:
        return None
    if logits.shape[1] == 0 or not sampling_kernel_available():
        return None
    f32 = dict(dtype=torch.float32)
    return torch.ops.pagedserve_cpu.sample_rows.default(
        logits.contiguous(), torch.tensor(temperature, **f32), torch.tensor(top_k, dtype=torch.int64),
        torch.tensor(top_p, **f32), torch.tensor(min_p, **f32), torch.tensor(u, **f32))


def logprob_rows(
    logits: torch.Tensor,  # [R, V] float32
    targets: Sequence[int],  # [R]
    k: int,
) -> list[tuple[float, int, list[tuple[int, float]]]] | None:
    """Per row: (logprob of the target, its rank (1 + how many logits are larger), the k largest
    (token, logprob), largest first, equal values by index); None when the kernel does not
    apply. NOTE: NaN logits count as absent."""
    if logits.dim() != 2 or logits.dtype is not torch.float32 or not logits.is_cpu:
        return None
    if logits.shape[1] == 0 or not 0 <= k <= logits.shape[1] or not sampling_kernel_available():
        return None
    lp, rank, top_val, top_idx = torch.ops.pagedserve_cpu.logprob_rows.default(
        logits.contiguous(), torch.tensor(targets, dtype=torch.int64), k)
    tops = [list(zip(i, v)) for i, v in zip(top_idx.tolist(), top_val.tolist())]
    return list(zip(lp.tolist(), rank.tolist(), tops))
