"""Count what engine steps cost in instructions and cache misses (deterministic, unlike timings
on a shared machine): valgrind's callgrind over `bench step-overhead`'s engine, instrumented for
the measured decode steps only. Used for docs/benchmarks.md ("The median at 1024").

    valgrind --tool=callgrind --instr-atstart=no --cache-sim=yes --D1=32768,8,64 \\
        --I1=32768,8,64 --LL=1048576,8,64 --callgrind-out-file=/tmp/cg.out \\
        python scripts/callgrind_step.py 1024 8

(needs gcc and valgrind's headers: the start/stop requests are compiled into a tiny shared
library at first use). Per sequence and step: valgrind's "I refs" / (N * steps) instructions,
"LLd misses" / (N * steps) data misses of the simulated 1 MB last level (one core's L2);
`callgrind_annotate --show=Ir,DLmr,DLmw --sort=DLmr /tmp/cg.out.1` by CPython function.
"""

import ctypes
import gc
import random
import subprocess
import sys
import tempfile
from pathlib import Path

SHIM = """#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""


def shim() -> ctypes.CDLL:
    folder = Path(tempfile.gettempdir()) / "pagedserve-callgrind"
    lib = folder / "libcg.so"
    if not lib.exists():
        folder.mkdir(exist_ok=True)
        (folder / "cg.c").write_text(SHIM)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(folder / "cg.c")],
                       check=True)
    return ctypes.CDLL(str(lib))


def main() -> None:
    import torch

    from pagedserve.bench import step_overhead as so
    from pagedserve.sampling_params import SamplingParams

    torch.set_num_threads(1)
    n = int(sys.argv[1])
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    cg = shim()
    folder = Path(tempfile.gettempdir()) / "pagedserve-callgrind" / "m"
    engine = so.build_engine(str(so.tiny_llama_folder(folder)), n, 16, 32, 0)
    rng = random.Random(1)
    params = SamplingParams(temperature=1.0, max_tokens=80, ignore_eos=True)
    for i in range(n):
        prompt = [1] + [rng.randrange(3, engine.vocab_size) for _ in range(15)]
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    sched = engine.scheduler
    while sched.waiting or any(not sched._is_decoding(g) for g in sched.running):
        engine.step()
    for _ in range(16):
        engine.step()
    gc.collect()
    engine.step()
    engine.step()
    cg.cg_start()
    for _ in range(steps):
        engine.step()
    cg.cg_stop()
    print(f"{steps} decode steps at {len(sched.running)} running sequences counted")


if __name__ == "__main__":
    main()
