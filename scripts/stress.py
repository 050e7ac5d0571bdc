"""The differential stress harness for as long as asked (tests/engine/stress_harness.py).

    python scripts/stress.py --minutes 30            # random seeds from --seed-start (default 0)
    python scripts/stress.py --seed 1234             # one seed (a repro), with its workload shown
    python scripts/stress.py --minutes 5 --tp        # the same on tensor_parallel_size=2 ("mp")
    python scripts/stress.py --minutes 5 --spec      # speculating (n-gram) against the oracle
    python scripts/stress.py --minutes 5 --spec draft  # with a draft model (the target itself)
    python scripts/stress.py --minutes 5 --recurrent --spec oracle  # drafts from the oracle

Every seed draws a workload (requests, arrivals, aborts, priorities) and a cache configuration
(issue 25's shapes among them: pools that hold one sequence of a wide request but not all of
them, priority scheduling, a prefilling group ahead of a decoding sharing group), runs it step
by step on a tiny random float32 Llama (`--hybrid`: a tiny Gemma 3 mixing sliding-window and full
layers) and compares every request's output exactly with its run
on a roomy cache (see the harness; the exactness rests on the engine's batch-invariant float32
CPU kernels, kernels/cpu_fp32.py). Prints progress, and every failing seed with a one-line repro;
exits 1 if any seed failed. CI runs a fixed set of seeds (tests/engine/test_stress.py).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "engine")]

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=None, help="run random seeds for this long")
    ap.add_argument("--seed", type=int, action="append", help="run this seed (repeatable)")
    ap.add_argument("--seed-start", type=int, default=0, help="first seed of a timed run")
    ap.add_argument("--tp", action="store_true", help="tensor_parallel_size=2 (mp workers)")
    ap.add_argument("--spec", nargs="?", const="ngram", choices=["ngram", "draft", "oracle"],
                    default=None,
                    help="speculate (a configuration per seed) against the non-speculative "
                         "oracle: n-gram (the default), or 'draft': a draft model (the tiny "
                         "model itself, so that greedy drafts are accepted), some seeds n-gram, "
                         "or 'oracle': drafts from the oracle's outputs, some spoiled (any "
                         "model, the recurrent one included)")
    ap.add_argument("--hybrid", action="store_true",
                    help="on a tiny model mixing sliding-window and full layers (issue 36: a "
                         "block table per layer group over one pool)")
    ap.add_argument("--conv", action="store_true",
                    help="on a tiny LFM2 (short-convolution state kept as a sliding window of "
                         "the cache), with --hybrid's pools")
    ap.add_argument("--recurrent", action="store_true",
                    help="on a tiny Qwen3.5 (a Gated DeltaNet layer: its recurrent state in "
                         "cache entries of each sequence's first block), pools grown for it")
    ap.add_argument("--model", type=Path, default=None,
                    help="checkpoint folder to reuse (default: a fresh tiny Llama in a temp dir)")
    ap.add_argument("--verbose", action="store_true", help="print every seed's workload")
    args = ap.parse_args()
    if args.minutes is None and not args.seed:
        ap.error("give --minutes N or --seed S")

    import torch

    import stress_harness as sh

    torch.set_num_threads(1)
    model = args.model or Path(tempfile.mkdtemp(prefix="pagedserve-stress-")) / (
        "recurrent" if args.recurrent else "conv" if args.conv else "hybrid" if args.hybrid
        else "llama")
    started = time.monotonic()
    model = (sh.tiny_recurrent(model) if args.recurrent else sh.tiny_conv(model) if args.conv
             else sh.tiny_hybrid(model) if args.hybrid else sh.tiny_llama(model))
    draft = model if args.spec == "draft" else None
    if draft is not None and args.tp:
        ap.error("--spec draft runs with tensor_parallel_size=1 only (no --tp)")
    engine = sh.make_engine(model, tp=2 if args.tp else 1, draft=draft)
    spec = {None: None, "ngram": sh.spec_config_for,
            "oracle": sh.oracle_spec_config_for}.get(args.spec) or (
        sh.draft_spec_config_for(draft) if draft is not None else None)
    harness = sh.Harness(engine, spec=spec)
    print(f"engine ready in {time.monotonic() - started:.1f}s (tp={2 if args.tp else 1})",
          flush=True)

    seeds = iter(args.seed) if args.seed else _count(args.seed_start)
    deadline = None if args.minutes is None else time.monotonic() + 60 * args.minutes
    counts: collections.Counter = collections.Counter()
    failed: list[tuple[int, str]] = []
    t0 = last = time.monotonic()
    try:
        for seed in seeds:
            if deadline is not None and time.monotonic() > deadline:
                break
            grouped = args.hybrid or args.conv
            workload = (sh.recurrent_workload(seed) if args.recurrent
                        else sh.hybrid_workload(seed) if grouped else sh.make_workload(seed))
            if args.verbose or args.seed:
                print(f"seed {seed}: {workload.describe()}", flush=True)
            try:
                stats = harness.run(workload)
            except sh.StressFailure as e:
                counts["failed"] += 1
                failed.append((seed, e.cause))
                print(f"FAIL seed {seed} [{e.cause}] {e}\n    {workload.describe()}\n"
                      f"    repro: {sh.repro(seed, args.tp, args.spec, args.hybrid, args.conv, args.recurrent)}",
                      flush=True)
                continue
            counts["passed"] += 1
            counts["steps"] += stats.steps
            counts["rejected requests"] += stats.rejected
            counts["aborted requests"] += stats.aborted
            counts["configs refused"] += stats.config_rejected
            for mode, n in stats.preemptions.items():
                if n:
                    counts[f"workloads preempting by {mode}"] += 1
            for shape in workload.shapes:
                counts[f"shape {shape}"] += 1
            if stats.turns:
                counts["workloads running a group in turns"] += 1
            if stats.prefix_hits:
                counts["workloads with prefix-cache hits"] += 1
            if stats.undone_victims:
                counts["workloads preempting a group scheduled earlier in the step"] += 1
            if time.monotonic() - last > 30 or args.seed:
                last = time.monotonic()
                print(f"[{last - t0:6.0f}s] up to seed {seed}: {counts['passed']} passed, "
                      f"{counts['failed']} failed", flush=True)
    finally:
        engine.shutdown()
    elapsed = time.monotonic() - t0
    total = counts["passed"] + counts["failed"]
    print(f"\n{total} workloads in {elapsed:.0f}s ({elapsed / max(total, 1):.2f}s each): "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if failed:
        by_cause = collections.defaultdict(list)
        for seed, cause in failed:
            by_cause[cause].append(seed)
        print("failing seeds by cause:")
        for cause, ss in sorted(by_cause.items()):
            more = " ..." if len(ss) > 40 else ""
            print(f"  {cause}: {len(ss)}: {' '.join(map(str, ss[:40]))}{more}")
        return 1
    return 0


def _count(start: int):
    while True:
        yield start
        start += 1


if __name__ == "__main__":
    sys.exit(main())
