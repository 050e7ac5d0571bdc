"""Micro-benchmark: the small-batch 8-bit kernel, AVX2 body (isa 1) against its AVX512-VNNI twin
(isa 3, csrc/qlinear_q8_vnni.h), on a GGUF file's own tensors, weights out of cache.

    python scripts/bench_q8_onerow.py /tmp/moe-hf/moe-Q4_K_M.gguf --rows 1,2,4 --threads 1

Times `torch.ops.pagedserve_cpu.qlinear` (gemm_rows 0: the small-batch kernel) on the LM head
(`output.weight`), 8 experts' gate and down (`blk.0.ffn_gate_exps`, `blk.2.ffn_down_exps`;
rotated through all 128 experts' groups, so the reads miss the L3 as in decode) and the
attention projections; asserts both ISAs give equal outputs; prints GB/s of weight bytes. With
one thread the time is the thread's CPU time (less sensitive to a shared machine), the 30th
percentile of interleaved calls. Needs an AVX512-BF16 CPU for isa 3 (docs/benchmarks.md,
issue 35's MoE section).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--rows", default="1", help="comma-separated row counts of x")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from gguf import GGUFReader

    from pagedserve.kernels.cpu_qlinear import FORMATS, GGML_FORMATS, quantized_available

    if not quantized_available():
        raise SystemExit("the compiled kernels are unavailable")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    reader = GGUFReader(args.gguf)
    tensors = {t.name: t for t in reader.tensors}

    def rows_of(t):
        fmt = FORMATS[GGML_FORMATS[t.tensor_type.name]]
        return fmt, int(t.shape[0]), torch.from_numpy(np.asarray(t.data).reshape(-1, fmt.row_bytes(int(t.shape[0]))))

    cases = []
    if "output.weight" in tensors:
        fmt, k, w = rows_of(tensors["output.weight"])
        cases.append(("output.weight", fmt, k, [w]))
    for name in ("blk.0.ffn_gate_exps.weight", "blk.2.ffn_down_exps.weight"):
        if name in tensors:
            fmt, k, w = rows_of(tensors[name])
            n_exp = int(tensors[name].shape[2]) if len(tensors[name].shape) > 2 else 1
            per = w.shape[0] // n_exp
            groups = max(1, n_exp // 8)
            cases.append((name, fmt, k, [w[i * 8 * per:(i + 1) * 8 * per] for i in range(groups)]))
    attn = [t for n, t in tensors.items() if n.endswith(("attn_q.weight", "attn_output.weight"))]
    if attn:
        fmt, k, _ = rows_of(attn[0])
        ws = [rows_of(t)[2].clone() for t in attn if int(t.shape[0]) == k and rows_of(t)[0] == fmt]
        cases.append(("attn_q/attn_output", fmt, k, ws * 4))
    for name, fmt, k, ws in cases:
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k).to(torch.bfloat16)

            def op(w, isa):
                return torch.ops.pagedserve_cpu.qlinear.default(x, w, fmt.code, k, None, False, isa, 0)

            if not torch.equal(op(ws[0], 1), op(ws[0], 3)):
                raise SystemExit(f"{name}: the two ISAs disagree")
            times = {1: [], 3: []}
            for _ in range(6 if len(ws) > 1 else 4):
                for isa in (1, 3):
                    for w in ws:
                        t0 = clock()
                        op(w, isa)
                        times[isa].append(clock() - t0)
            a, b = (float(np.percentile(times[i], 30)) for i in (1, 3))
            nbytes = ws[0].numel()
            print(f"{name:28s} {fmt.name:5s} N={ws[0].shape[0]:7d} K={k} M={m} x{len(ws)}: "
                  f"avx2 {a * 1e3:7.3f} ms ({nbytes / a / 1e9:5.1f} GB/s)  "
                  f"vnni {b * 1e3:7.3f} ms ({nbytes / b / 1e9:5.1f} GB/s)  {a / b:4.2f}x", flush=True)


if __name__ == "__main__":
    main()
