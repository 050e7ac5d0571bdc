"""Where the start-up of `pagedserve generate` / `serve` goes, phase by phase, in a fresh process.

    python scripts/startup_profile.py [--model PATH] [--runs 3]

Each run is a new Python process (cold imports) that times: importing torch, importing the
engine (and, for serve, the HTTP server's modules), loading the compiled CPU kernels (prebuilt:
dlopen; a source checkout: the JIT build, cached after the first), resolving the model (the
embedded GGUF), reading the weights, the tokenizer (the embedded GGUF's is converted once and
cached under ~/.cache/pagedserve), the structured-output manager, allocating the KV cache, the
rest of the engine's set-up, and the first `generate` of one token (prefill + first token: the
warm-up every first request pays). Prints, per phase, the median wall time over the runs and the
process's CPU time (on a machine shared with other jobs the wall time includes waiting for a core;
the CPU time does not, but it sums the threads of multi-threaded phases) as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r'''
import json, sys, time
T, C, CPU = {}, {}, {}
t0 = time.perf_counter()
def mark(name, t):
    T[name] = T.get(name, 0.0) + (time.perf_counter() - t)
    C[name] = C.get(name, 0.0) + (time.process_time() - CPU.pop(t, 0.0))
_perf = time.perf_counter
def _stamp():
    t = _perf(); CPU[t] = time.process_time(); return t
time.perf_counter = _stamp
t = time.perf_counter(); import torch; mark("import torch", t)
t = time.perf_counter()
from pagedserve import LLM, SamplingParams
from pagedserve.engine import llm, llm_engine
from pagedserve.worker import worker, kv_cache, model_runner
from pagedserve.models import source as source_mod
mark("import pagedserve (engine)", t)
t = time.perf_counter(); import pagedserve.entrypoints.openai.api_server; mark("import the HTTP server (serve only)", t)
t = time.perf_counter()
from pagedserve.kernels.extension import all_extensions
origins = []
for ext in all_extensions():
    ext.isa(); origins.append(ext.origin)
mark("CPU kernels (" + "/".join(sorted(set(map(str, origins)))) + ")", t)

def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            mark(name, t)
    return wrapper
llm_engine.resolve_model = timed("resolve the model (embedded GGUF)", llm_engine.resolve_model)
worker.load_model = timed("read the weights (GGUF -> tensors)", worker.load_model)
source_mod.ModelSource.load_tokenizer = timed("tokenizer", source_mod.ModelSource.load_tokenizer)
llm_engine.StructuredOutputManager = timed("structured-output manager", llm_engine.StructuredOutputManager)
kv_cache.KVCache.__init__ = timed("KV cache allocation", kv_cache.KVCache.__init__)
model_runner.ModelRunner.__init__ = timed("model runner", model_runner.ModelRunner.__init__)
t = time.perf_counter()
c = time.process_time()
engine = LLM(MODEL)
total_engine = _perf() - t
total_cpu = time.process_time() - c
PARTS = ("resolve the model (embedded GGUF)", "read the weights (GGUF -> tensors)", "tokenizer",
         "structured-output manager", "KV cache allocation", "model runner")
T["rest of the engine set-up"] = total_engine - sum(v for k, v in T.items() if k in PARTS)
C["rest of the engine set-up"] = total_cpu - sum(v for k, v in C.items() if k in PARTS)
t = time.perf_counter()
engine.generate("The capital of France is", SamplingParams(max_tokens=1), use_tqdm=False)
mark("first generate, 1 token (warm-up: prefill + token)", t)
T["total to the first token"] = _perf() - t0
C["total to the first token"] = time.process_time()
print("JSON" + json.dumps({"wall": T, "cpu": C}))
'''


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    runs = []
    for i in range(args.runs):
        code = f"MODEL = {args.model!r}\n" + CHILD
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if out.returncode:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        line = next(li for li in out.stdout.splitlines() if li.startswith("JSON"))
        runs.append(json.loads(line[4:]))
        print(f"run {i + 1}: {runs[-1]['wall']['total to the first token']:.2f} s", file=sys.stderr)
    print(f"| phase | wall s, median of {args.runs} (min - max) | CPU s of the process, median |\n"
          "| --- | --- | --- |")
    for name in runs[0]["wall"]:
        wall = [r["wall"].get(name, 0.0) for r in runs]
        cpu = [r["cpu"].get(name, 0.0) for r in runs]
        print(f"| {name} | {statistics.median(wall):.2f} ({min(wall):.2f} - {max(wall):.2f}) | "
              f"{statistics.median(cpu):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
