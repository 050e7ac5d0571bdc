"""Where a decode step's time goes, by compiled symbol: `perf record` over the decode steps alone
(prefill excluded) of ROWS sequences on one in-process engine, GGUF blocks kept, bf16.

    python scripts/perf_decode_step.py 1 40 /tmp/perf1.data                      # embedded Gemma 3
    python scripts/perf_decode_step.py 1 40 /tmp/perf1.data /tmp/moe-hf/moe-Q4_K_M.gguf /tmp/moe-hf
    perf report -i /tmp/perf1.data --no-children --sort symbol -g none | head -20

Arguments: ROWS, STEPS, the perf output file (`-`: no perf, the step time only), then optionally
a GGUF file and its tokenizer's folder. Prompts are 160 random token ids below 7000. Needs
`perf` on PATH (linux-tools). Used for docs/benchmarks.md's MoE profile (issue 35).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__)
        return 2
    rows, steps, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from pagedserve import LLM, SamplingParams
    from pagedserve.models.embedded import embedded_model_path

    model = sys.argv[4] if len(sys.argv) > 4 else str(embedded_model_path())
    extra = {"tokenizer": sys.argv[5]} if len(sys.argv) > 5 else {}
    llm = LLM(model, dtype="bfloat16", quantization="gguf", max_num_seqs=rows,
              max_model_len=1024, **extra)
    engine = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0.0)
    for i in range(rows):
        engine.add_request(str(i), None, params,
                           prompt_token_ids=[rng.randrange(100, 7000) for _ in range(160)])
    while True:  # every prompt prefilled: each request has its first token
        outs = engine.step()
        if len(outs) == rows and all(o.outputs[0].token_ids for o in outs):
            break
    for _ in range(3):  # warm decode steps
        engine.step()
    perf = None
    if out != "-":
        perf = subprocess.Popen(["perf", "record", "-F", "999", "-g", "-o", out, "-p", str(os.getpid())],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # perf attaches
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    if perf is not None:
        perf.send_signal(signal.SIGINT)
        perf.wait()
    print(f"rows={rows}: decode step {elapsed / steps * 1000:.1f} ms ({rows * steps / elapsed:.1f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
