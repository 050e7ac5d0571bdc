"""A tensor-parallel worker killed mid-request: how fast the server notices.

Starts the tests' tiny random Llama with --tensor-parallel-size 2, opens --streams streaming
requests, SIGKILLs one worker process while they decode, and measures from the kill: when each
in-flight stream got its error (or ended), when /health first answered 503 (or stopped
answering), and when the server
process exited (it must, non-zero, within 10 s). Repeats --runs times; writes
docs/figures/worker_death.png.

    .venv/bin/python scripts/worker_death.py [--runs 3]
"""

import argparse
import asyncio
import os
import signal
import statistics
import time

import httpx
from _reliability import FIGURES, bar_chart, start_tiny_server
from server_utils import MAX_MODEL_LEN, worker_pids


async def one_run(streams: int) -> dict[str, float]:
    server = start_tiny_server("--tensor-parallel-size", "2", "--log-stats-interval", "0")
    proc = server.proc
    killed_at: list[float] = []
    stream_done: list[float] = []
    outcomes: list[str] = []
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            started = asyncio.Event()

            async def stream() -> None:
                # As long as the tiny model allows (MAX_MODEL_LEN): still decoding at the kill.
                body = {"prompt": "hello " * 8, "max_tokens": MAX_MODEL_LEN - 32,
                        "ignore_eos": True, "stream": True}
                outcome = "ended without error"
                try:
                    async with client.stream("POST", "/v1/completions", json=body) as resp:
                        async for line in resp.aiter_lines():
                            if '"error"' in line:
                                outcome = "error event"
                                break
                            if line.startswith("data:"):
                                started.set()
                except httpx.HTTPError as e:
                    outcome = f"connection closed ({type(e).__name__})"
                stream_done.append(time.monotonic())
                outcomes.append(outcome)

            tasks = [asyncio.ensure_future(stream()) for _ in range(streams)]
            await asyncio.wait_for(started.wait(), 30)
            await asyncio.sleep(0.1)  # decoding
            victims = worker_pids(proc.pid)
            if len(victims) != 2:
                raise RuntimeError(f"expected 2 workers, found {victims}")
            os.kill(victims[-1], signal.SIGKILL)
            killed_at.append(time.monotonic())
            health_503 = None  # /health answered 503 (or no longer answered at all)
            while proc.poll() is None and time.monotonic() - killed_at[0] < 15:
                try:
                    r = await client.get("/health", timeout=1)
                    down = r.status_code == 503
                except httpx.HTTPError:
                    down = True
                if down and health_503 is None:
                    health_503 = time.monotonic()
                await asyncio.sleep(0.05)
            exit_at = time.monotonic() if proc.poll() is not None else None
            await asyncio.wait(tasks, timeout=5)
    finally:
        code = server.stop(signal.SIGKILL) if proc.poll() is None else proc.returncode
    t0 = killed_at[0]
    return {
        "streams_failed_s": max(stream_done) - t0 if len(stream_done) == streams else float("nan"),
        "in_flight_at_kill": sum(d > t0 for d in stream_done),
        "health_503_s": health_503 - t0 if health_503 else float("nan"),
        "exit_s": exit_at - t0 if exit_at else float("nan"),
        "exit_code": float(code),
        "outcomes": outcomes,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", type=int, default=4)
    args = p.parse_args()
    runs = [asyncio.run(one_run(args.streams)) for _ in range(args.runs)]
    ok = True
    for i, r in enumerate(runs):
        print(f"run {i + 1}: every stream failed {r['streams_failed_s']:.2f} s after the kill, "
              f"/health 503 at {r['health_503_s']:.2f} s, exit at {r['exit_s']:.2f} s "
              f"(code {int(r['exit_code'])}); {r['in_flight_at_kill']} streams in flight at the "
              f"kill: {sorted(set(r['outcomes']))}")
        ok &= r["exit_s"] < 10 and r["exit_code"] != 0
    keys = ("streams_failed_s", "health_503_s", "exit_s")
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    print("median seconds after the kill: " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    bar_chart(FIGURES / "worker_death.png", "TP worker killed: seconds to detect (median)",
              ["streams failed", "/health 503", "process exit"],
              [round(med[k], 2) for k in keys])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
