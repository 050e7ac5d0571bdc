"""Micro-benchmark: the CPU attention kernels (csrc/prefill_attention.cpp, csrc/paged_attention.cpp)
at each ISA level this CPU runs, on the same inputs, side by side.

    python scripts/bench_attention_isa.py                         # amx vs avx512bf16, Gemma 3 shapes
    python scripts/bench_attention_isa.py --isas avx512bf16,avx2 --decode
    python scripts/bench_attention_isa.py --decode --layers 18     # a decode step's 18 layers

Prompt attention: a chunk of n query rows (4 heads of 256 over one KV head: Gemma 3 270M) over
a context of ctx keys, causal, with and without a 512-key window. Decode (`--decode`): one query
per sequence over S sequences' paged caches (blocks of 16, shuffled); `--layers N` gives each of
N layers its own caches and times one call per layer, as a decode step does (N = 18: Gemma 3's
caches stream from memory instead of sitting in cache between calls). Prints the best time of
--reps calls per level and the ratio to the first level; `$PAGEDSERVE_CPU_ISA` caps the level the
wrappers ask for (read on every call). Timings on a shared machine are noise: run it idle.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from pagedserve.kernels.cpu_attention import decode_attention, prefill_attention

PREFILL = [(160, 160, None), (512, 512, None), (2048, 2048, None), (2048, 2048, 512),
           (2048, 8192, None), (2048, 8192, 512)]  # (n, ctx, window)
DECODE = [(7, 8192, 4, 1, 256), (64, 256, 4, 1, 256), (16, 1024, 4, 1, 256),
          (64, 256, 32, 4, 128), (1, 2048, 4, 1, 256)]  # (S, ctx, Hq, Hkv, D)


def best_of(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isas", default="amx,avx512bf16")
    ap.add_argument("--decode", action="store_true", help="the decode kernel instead of the prompt kernel")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=1,
                    help="decode: caches of this many layers, one call each per timing")
    args = ap.parse_args()
    isas = args.isas.split(",")
    g = torch.Generator().manual_seed(0)
    cases = DECODE if args.decode else PREFILL
    for case in cases:
        if args.decode:
            s, ctx, hq, hkv, d = case
            nb = (ctx + 15) // 16
            caches = [(torch.randn(s * nb, 16, hkv, d, generator=g).bfloat16(),
                       torch.randn(s * nb, 16, hkv, d, generator=g).bfloat16()) for _ in range(args.layers)]
            bt = torch.randperm(s * nb, generator=g).view(s, nb)
            sl = torch.full((s,), ctx)
            q = torch.randn(s, hq, d, generator=g).bfloat16()
            fn = lambda: [decode_attention(q, kc, vc, bt, sl, d ** -0.5) for kc, vc in caches]  # noqa: E731
            name = f"decode S={s} ctx={ctx} heads {hq}/{hkv} x {d}" + (f" x{args.layers}" if args.layers > 1 else "")
        else:
            n, ctx, w = case
            q = torch.randn(n, 4, 256, generator=g).bfloat16()
            k = torch.randn(ctx, 1, 256, generator=g).bfloat16()
            v = torch.randn(ctx, 1, 256, generator=g).bfloat16()
            out = torch.empty_like(q)
            fn = lambda: prefill_attention(q, k, v, out, 0.0625, w)  # noqa: E731
            name = f"prompt n={n} ctx={ctx} window={w}"
        times = []
        for isa in isas:
            os.environ["PAGEDSERVE_CPU_ISA"] = isa
            times.append(best_of(fn, args.reps))
        cells = "  ".join(f"{isa} {t * 1e3:8.2f} ms" for isa, t in zip(isas, times))
        ratios = "  ".join(f"{times[i] / times[0]:.2f}x" for i in range(1, len(times)))
        print(f"{name:42s} {cells}   {isas[0]} faster by {ratios}")


if __name__ == "__main__":
    main()
