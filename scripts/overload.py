"""Overload: 10x more concurrent requests than a small server holds (--max-num-seqs 4,
--max-queued-requests 8: 12 at once); each must complete or get 503 + Retry-After, none lost.

    .venv/bin/python scripts/overload.py [--requests 120]
"""

import argparse
import asyncio

from _reliability import FIGURES, bar_chart, start_tiny_server

from pagedserve.bench.reliability import overload, rss_bytes, wait_idle


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    server = start_tiny_server("--max-num-seqs", "4", "--max-queued-requests", "8",
                               "--enable-debug-endpoints", "--log-stats-interval", "0")
    try:
        rss0 = rss_bytes(server.proc.pid)
        result = overload(server.url, args.requests, max_tokens=args.max_tokens)
        result = asyncio.run(result)
        state = asyncio.run(wait_idle(server.url))
        rss1 = rss_bytes(server.proc.pid)
    finally:
        server.stop()
    print(f"sent {result.sent}  completed {result.completed}  refused (503 + Retry-After) "
          f"{result.refused}  lost {result.lost}")
    print(f"afterwards: used KV blocks {state['used_blocks']}, invariants ok "
          f"{state['invariants_ok']}; server RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB")
    for reason in result.lost_reasons[:10]:
        print("  lost:", reason)
    bar_chart(FIGURES / "overload.png", f"Overload: {result.sent} concurrent requests, "
              "capacity 12", ["sent", "completed", "refused 503", "lost"],
              [result.sent, result.completed, result.refused, result.lost])
    return 0 if result.lost == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
