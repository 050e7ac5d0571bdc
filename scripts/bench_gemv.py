"""Micro-benchmark: torch's bf16 F.linear vs pagedserve's compiled CPU product
(`kernels.cpu_gemm.bf16_linear`) on bf16 weights, at each ISA level asked for.

    python scripts/bench_gemv.py                        # Gemma 3 270M shapes, M in 1..32
    python scripts/bench_gemv.py --cold                 # rotate weight copies (out of cache)
    python scripts/bench_gemv.py --isas avx2,amx --m 1,16

Prints one row per (shape, M): effective weight bandwidth (N*K*2 bytes / time per call) of torch
and of the kernel, and their ratio. Torch and the kernel are timed alternately in the same process
(--repeats rounds each), every call on its own; the time per call is a low percentile (--pct, 10 by
default) of all calls, which shrugs off the calls that other processes on a shared machine
preempted. Figures are indicative.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_gemm
from pagedserve.kernels.cpu_isa import ISA_ENV, ISA_LEVELS, ISA_NAMES

# (name, N, K) of Gemma 3 270M: LM head, q / k,v / o, gate,up / down
SHAPES = [
    ("lm_head", 262144, 640),
    ("q_proj", 1024, 640),
    ("kv_proj", 256, 640),
    ("o_proj", 640, 1024),
    ("gate_up", 2048, 640),
    ("down", 640, 2048),
]


def _time(fn, weights, x, min_time: float) -> list[float]:
    """Seconds of each call, cycling through the weight copies until min_time has passed."""
    fn(x, weights[0])
    times, i = [], 0
    end = time.perf_counter() + min_time
    while True:
        t0 = time.perf_counter()
        fn(x, weights[i])
        t1 = time.perf_counter()
        times.append(t1 - t0)
        i = (i + 1) % len(weights)
        if t1 >= end:
            return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,2,4,8,16,32", help="comma-separated M values")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="shape names to run")
    ap.add_argument("--isas", default="", help="ISA levels to time, e.g. avx2,amx (default: the best)")
    ap.add_argument("--cold", action="store_true", help="cycle weight copies (>= 512 MB) so reads miss cache")
    ap.add_argument("--repeats", type=int, default=5, help="alternating timing rounds")
    ap.add_argument("--pct", type=float, default=10.0, help="percentile of per-call times reported")
    ap.add_argument("--min-time", type=float, default=0.1, help="seconds per timing round")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    best = cpu_gemm.linear_isa()
    if not best:
        raise SystemExit("kernel unavailable here (see the warning above)")
    algos = [a for a in args.isas.split(",") if a] or [ISA_NAMES[best]]
    skipped = [a for a in algos if ISA_LEVELS.get(a, 99) > best]
    if skipped:
        raise SystemExit(f"--isas {','.join(skipped)}: above this CPU's best ({ISA_NAMES[best]})")
    ms = [int(v) for v in args.m.split(",")]
    wanted = set(args.shapes.split(","))
    print(f"threads={torch.get_num_threads()} cold={args.cold} best ISA={ISA_NAMES[best]}")
    head = f"{'shape':<8} {'N':>7} {'K':>5} {'M':>3} {'torch GB/s':>10}"
    for a in algos:
        head += f" {a + ' GB/s':>12} {'ratio':>6}"
    print(head)
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, n, k in SHAPES:
            if name not in wanted:
                continue
            nbytes = n * k * 2
            copies = max(1, (512 << 20) // nbytes) if args.cold else 1
            weights = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
            for m in ms:
                x = torch.randn(m, k).to(torch.bfloat16)
                fns = {"torch": lambda x, w: F.linear(x, w)}
                for a in algos:
                    fns[a] = lambda x, w: cpu_gemm.bf16_linear(x, w)
                times: dict[str, list[float]] = {key: [] for key in fns}
                for _ in range(args.repeats):
                    for key, fn in fns.items():
                        os.environ[ISA_ENV] = key if key in ISA_LEVELS else ISA_NAMES[best]
                        times[key] += _time(fn, weights, x, args.min_time)
                gbs = {}
                for key, ts in times.items():
                    ts.sort()
                    gbs[key] = nbytes / ts[min(len(ts) - 1, int(len(ts) * args.pct / 100))] / 1e9
                row = f"{name:<8} {n:>7} {k:>5} {m:>3} {gbs['torch']:>10.1f}"
                for a in algos:
                    row += f" {gbs[a]:>12.1f} {gbs[a] / gbs['torch']:>6.2f}"
                print(row, flush=True)
            del weights


if __name__ == "__main__":
    main()
