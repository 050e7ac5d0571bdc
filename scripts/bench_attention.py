"""Micro-benchmark: the bf16 attention kernels against torch, one thread by default.

    python scripts/bench_attention.py                 # Gemma 3 270M's heads: 4 query, 1 KV, 256
    python scripts/bench_attention.py --threads 2 --prompt-lens 160 512

Prompt attention: `kernels.cpu_attention.prefill_attention` (AVX512-BF16) against
`F.scaled_dot_product_attention(is_causal=True)` on the same bf16 tensors (GFLOP/s count the
causal half: 4 n^2 / 2 D per head). Decode attention: `decode_attention` over sequences whose
blocks are scattered through a cache (as the engine's are) and, for reference, all sharing the
same blocks (cache-resident). Times are a low percentile (--pct) of many calls.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_attention import decode_attention, prefill_attention


def per_call(fn, reps: int, pct: float) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[int(len(times) * pct / 100)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heads", type=int, nargs=3, default=[4, 1, 256], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[160, 512])
    ap.add_argument("--decode", type=int, nargs=2, default=[64, 210], metavar=("SEQS", "CTX"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--pct", type=float, default=20.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hq, hkv, d = args.heads
    scale = d ** -0.5
    for n in args.prompt_lens:
        q = torch.randn(n, hq, d).to(torch.bfloat16)
        k, v = (torch.randn(n, hkv, d).to(torch.bfloat16) for _ in range(2))
        out = torch.empty_like(q)
        flops = 4 * n * n / 2 * d * hq
        ours = per_call(lambda: prefill_attention(q, k, v, out, scale), args.reps, args.pct)
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        sdpa = per_call(lambda: F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=hkv != hq), args.reps, args.pct)
        print(f"prompt {n:5d} tokens: ours {1e3 * ours:8.2f} ms ({flops / ours / 1e9:6.1f} GFLOP/s)"
              f"   sdpa {1e3 * sdpa:8.2f} ms ({flops / sdpa / 1e9:6.1f})   {sdpa / ours:.1f}x")
    seqs, ctx = args.decode
    bs = 16
    nb = -(-ctx // bs)
    q = torch.randn(seqs, hq, d).to(torch.bfloat16)
    lens = torch.full((seqs,), ctx, dtype=torch.long)
    for shared in (False, True):
        kc = torch.randn((nb if shared else seqs * nb) + 1, bs, hkv, d).to(torch.bfloat16)
        vc = torch.randn_like(kc)
        tables = (torch.arange(nb).repeat(seqs, 1) if shared
                  else torch.randperm(seqs * nb).view(seqs, nb)).long().contiguous()
        t = per_call(lambda: decode_attention(q, kc, vc, tables, lens, scale), args.reps, args.pct)
        print(f"decode {seqs} seqs x {ctx} tokens ({'blocks shared, cache-resident' if shared else 'scattered blocks'}):"
              f" {1e3 * t:.2f} ms, {1e9 * t / (seqs * ctx):.0f} ns per key")


if __name__ == "__main__":
    main()
