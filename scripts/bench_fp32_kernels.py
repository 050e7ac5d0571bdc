"""Micro-benchmark: torch's fp32 F.linear (MKL / oneDNN) and attention (SDPA) vs pagedserve's
batch-invariant fp32 kernels (kernels/cpu_fp32.py), decode (small M) and prefill (M = 512) shapes.

    PYTHONPATH=src python scripts/bench_fp32_kernels.py                  # tiny + Gemma 3 270M shapes
    PYTHONPATH=src python scripts/bench_fp32_kernels.py --m 1,16,512 --isa avx2 --threads 1
    PYTHONPATH=src python scripts/bench_fp32_kernels.py --attention      # Gemma 3 270M attention

Prints GFLOP/s (2*M*N*K / time per call) of torch and of the kernel and their ratio, per (shape, M);
with --attention, ms per layer call of the torch backend's SDPA path and of the kernel.
Both are timed alternately in the same process; the time per call is a low percentile (--pct) of
all calls, which shrugs off preemption by other processes on a shared machine. Indicative only.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_fp32

# (name, N, K): the tiny test llama (hidden 64, intermediate 128, vocab 512) and Gemma 3 270M
# (hidden 640, q 1024, kv 256, intermediate 2048, vocab 262144)
SHAPES = [
    ("tiny_qkv", 128, 64),
    ("tiny_gate_up", 256, 64),
    ("tiny_down", 64, 128),
    ("tiny_lm_head", 512, 64),
    ("gemma_q", 1024, 640),
    ("gemma_o", 640, 1024),
    ("gemma_gate_up", 4096, 640),
    ("gemma_down", 640, 2048),
    ("gemma_lm_head", 262144, 640),
]


def _time(fn, min_time: float, pct: float) -> float:
    fn()
    times = []
    end = time.perf_counter() + min_time
    while time.perf_counter() < end or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[min(len(times) - 1, int(len(times) * pct / 100))]


def _attention(args) -> None:
    """One Gemma 3 270M attention layer (4 query heads, 1 KV head, head_dim 256, blocks of 16):
    a 512-token prompt (fresh), a 64-token chunk over 448 cached, 16 decode rows at 512."""
    from pagedserve.attention.backends import torch_ref
    from pagedserve.attention.backends.base import AttentionBatch

    hq, hkv, d, bs = 4, 1, 256, 16
    cases = {"prefill 512": ([512], [512]), "chunk 64 @ 448": ([512], [64]),
             "decode 16 x 512": ([512] * 16, [1] * 16)}
    print(f"{'case':<18}{'torch ms':>10}{'ours ms':>10}{'ours/torch':>11}")
    for name, (lens, qlens) in cases.items():
        per = -(-max(lens) // bs)
        nb = per * len(lens)
        kc, vc = torch.randn(nb + 1, bs, hkv, d), torch.randn(nb + 1, bs, hkv, d)
        tables = [list(range(i * per, (i + 1) * per)) for i in range(len(lens))]
        meta = torch_ref.TorchAttentionBackend().build_metadata(AttentionBatch(
            block_tables=tables, seq_lens=lens, query_lens=qlens, block_size=bs, null_block=nb))
        t = sum(qlens)
        q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
        times = []
        for kernels in (False, True):  # torch's gather + SDPA, then the batch-invariant kernel
            # NOTE: the layers read PAGEDSERVE_DISABLE_CPU_KERNELS on every call
            os.environ["PAGEDSERVE_DISABLE_CPU_KERNELS"] = "0" if kernels else "1"
            times.append(_time(lambda: torch_ref.paged_attention(q, k, v, kc, vc, meta, 0.06, None),
                               args.min_time, args.pct))
        os.environ.pop("PAGEDSERVE_DISABLE_CPU_KERNELS")
        print(f"{name:<18}{times[0] * 1e3:>10.2f}{times[1] * 1e3:>10.2f}{times[0] / times[1]:>11.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,4,16,512", help="row counts (comma-separated)")
    ap.add_argument("--shapes", default="", help="names from SHAPES (comma-separated; default all)")
    ap.add_argument("--isa", default="auto", choices=sorted(cpu_fp32.ISAS))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds per (shape, M, impl)")
    ap.add_argument("--pct", type=float, default=10.0)
    ap.add_argument("--attention", action="store_true", help="benchmark attention instead")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_fp32.fp32_kernels_available():
        raise SystemExit("the fp32 kernels are unavailable here")
    if args.attention:
        with torch.inference_mode():
            _attention(args)
        return
    wanted = set(filter(None, args.shapes.split(",")))
    print(f"isa={cpu_fp32.best_isa() if args.isa == 'auto' else args.isa} threads={torch.get_num_threads()}")
    print(f"{'shape':<15}{'N':>8}{'K':>6}{'M':>6}{'torch GF/s':>12}{'ours GF/s':>11}{'ours/torch':>11}")
    with torch.inference_mode():
        for name, n, k in SHAPES:
            if wanted and name not in wanted:
                continue
            w = torch.randn(n, k)
            for m in (int(v) for v in args.m.split(",")):
                if n * m > 50_000_000:  # the vocab-sized LM head at prefill sizes: skip
                    continue
                x = torch.randn(m, k)
                t_torch = _time(lambda: F.linear(x, w), args.min_time, args.pct)
                t_ours = _time(lambda: cpu_fp32._kernel_linear(x, w, None, args.isa), args.min_time,
                               args.pct)
                flops = 2.0 * m * n * k
                print(f"{name:<15}{n:>8}{k:>6}{m:>6}{flops / t_torch / 1e9:>12.1f}"
                      f"{flops / t_ours / 1e9:>11.1f}{t_torch / t_ours:>11.2f}")


if __name__ == "__main__":
    main()
