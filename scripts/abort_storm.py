"""Abort storm: 2,000 streaming requests, about a third of the clients hanging up at random
points (before the first token, mid-decode, or after a random wait, also while preempted under
KV pressure); afterwards nothing may be running, waiting or swapped, no GPU or CPU block held,
and the engine's invariant check must pass.

    .venv/bin/python scripts/abort_storm.py [--requests 2000]
"""

import argparse
import asyncio
import time

import httpx
from _reliability import FIGURES, bar_chart, start_tiny_server

from pagedserve.bench.reliability import abort_storm, parse_metrics, wait_idle


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=24)
    args = p.parse_args()
    server = start_tiny_server("--max-num-seqs", "8", "--num-kv-blocks", "24",
                               "--preemption-mode", "swap", "--num-cpu-blocks", "128",
                               "--enable-debug-endpoints", "--log-stats-interval", "0")
    try:
        t0 = time.monotonic()
        result = asyncio.run(abort_storm(server.url, args.requests,
                                         concurrency=args.concurrency, seed=0,
                                         max_prompt_words=30, max_tokens=(2, 24)))
        took = time.monotonic() - t0
        state = asyncio.run(wait_idle(server.url))
        m = parse_metrics(httpx.get(server.url + "/metrics").text)
    finally:
        server.stop()
    leaked = state["used_blocks"] + state["used_cpu_blocks"]
    print(f"{result.sent} streams in {took:.0f} s: completed {result.completed}, dropped "
          f"{result.dropped}, refused {result.refused}, errors {len(result.errors)}")
    print(f"preemptions {state['preemptions']}; afterwards running {m['pagedserve:num_requests_running']:g}"
          f", waiting {m['pagedserve:num_requests_waiting']:g}, swapped "
          f"{m['pagedserve:num_requests_swapped']:g}, KV usage "
          f"{m['pagedserve:kv_cache_usage_perc']:g}; used blocks GPU {state['used_blocks']} "
          f"CPU {state['used_cpu_blocks']}; invariants ok {state['invariants_ok']}")
    for e in result.errors[:10]:
        print("  error:", e)
    dropped = sum(result.dropped.values())
    bar_chart(FIGURES / "abort_storm.png", f"Abort storm: {result.sent} streams",
              ["completed", "dropped", "preemptions", "leaked blocks"],
              [result.completed, dropped, state["preemptions"], leaked])
    ok = leaked == 0 and not result.errors and state["invariants_ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
