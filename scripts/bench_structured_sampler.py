"""The sampler's cost per step with JSON-schema token bitmasks, apart from the model step (issue 17).

Real masks: the `bench throughput --structured json` schema compiled against the embedded Gemma 3
tokenizer (262,144 tokens), 16 sequences at staggered positions of a JSON record, one mask per
sequence per step. Each step samples 16 rows of random fp32 logits with `worker.sampler.sample`:
unconstrained, with the masks on the CPU kernels (`kernels/cpu_grammar.py`), on the torch path
(kernels off), and as before issue 17's fix (xgrammar's `apply_token_bitmask_inplace`, then the
sampler). Also the masks' filling (one batched xgrammar call). Medians over the steps, in ms.

    PYTHONPATH=$PWD/src python scripts/bench_structured_sampler.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def masks_per_step(rows: int):
    import xgrammar as xgr

    from pagedserve.bench.structured import BENCH_SCHEMA
    from pagedserve.engine.llm import LLM
    from pagedserve.structured_output import StructuredOutputsParams

    llm = LLM("gemma-3-270m", dtype="bfloat16", load_format="dummy")
    mgr = llm.engine.structured
    compiled = mgr.compile(StructuredOutputsParams(json=BENCH_SCHEMA))
    record = {"name": "Alice Smith", "age": 42, "email": "alice@example.com", "role": "admin",
              "tags": ["a", "bcd"], "score": 3.5}
    ids = llm.engine.tokenizer.encode(json.dumps(record), add_special_tokens=False)
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    steps, fill = [], []
    for step in range(len(ids)):
        matchers = []
        for i in range(rows):
            m = xgr.GrammarMatcher(compiled)
            for t in ids[: (step + 3 * i) % len(ids)]:
                assert m.accept_token(t)
            matchers.append(m)
        bm = xgr.allocate_token_bitmask(rows, mgr.vocab_size)
        start = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bm)
        fill.append(time.perf_counter() - start)
        steps.append(bm)
    return steps, mgr.vocab_size, statistics.median(fill) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import xgrammar as xgr

    from pagedserve.kernels import cpu_grammar
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.structured_output import StructuredOutputsParams
    from pagedserve.worker.sampler import SampleRequest, sample

    steps, vocab, fill_ms = masks_per_step(args.rows)
    so = StructuredOutputsParams(regex="a")  # the masks are what counts
    logits0 = torch.randn(args.rows, vocab) * 3
    kernel_isa = cpu_grammar.isa_name() if cpu_grammar.available() else "unavailable"

    def reqs(mask, temp):
        return [SampleRequest(SamplingParams(temperature=temp, seed=i if temp else None,
                                             structured_outputs=so if mask is not None else None),
                              [1], [], torch.Generator().manual_seed(i) if temp else None,
                              token_bitmask=None if mask is None else mask[i])
                for i in range(args.rows)]

    def xgrammar_then_sample(x, rs):  # before issue 17's fix: xgrammar's CPU apply, then sample
        mask = torch.stack([r.token_bitmask for r in rs])
        xgr.apply_token_bitmask_inplace(x, mask)
        for r in rs:
            r.token_bitmask = None
        return sample(x, rs, [[]] * len(rs))

    print(f"rows={args.rows} vocab={vocab} threads={args.threads} grammar kernels={kernel_isa} "
          f"mask fill (16 matchers, batched) {fill_ms:.2f} ms median")
    for temp in (0.0, 1.0):
        cells = []
        for name in ("unconstrained", "kernels", "torch path", "xgrammar apply"):
            times = []
            for mask in steps:
                x = logits0.clone()
                rs = reqs(None if name == "unconstrained" else mask, temp)
                original = cpu_grammar.available
                if name == "torch path":
                    cpu_grammar.available = lambda: False
                try:
                    start = time.perf_counter()
                    if name == "xgrammar apply":
                        xgrammar_then_sample(x, rs)
                    else:
                        sample(x, rs, [[]] * args.rows)
                    times.append(time.perf_counter() - start)
                finally:
                    cpu_grammar.available = original
            cells.append(f"{name} {statistics.median(times) * 1e3:.2f}")
        kind = "greedy" if temp == 0.0 else f"temperature {temp}"
        print(f"{kind:>16}: " + ", ".join(cells) + " ms/step")


if __name__ == "__main__":
    main()
