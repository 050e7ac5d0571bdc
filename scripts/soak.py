"""Soak: the server on the embedded model (or --model) for --minutes under a mixed load
(streaming and not, n > 1, stop strings, clients hanging up), sampling the server's RSS and KV
usage every --interval seconds; writes docs/figures/soak.png and prints RSS growth after warm-up.

    .venv/bin/python scripts/soak.py --minutes 3
    MALLOC_ARENA_MAX=2 .venv/bin/python scripts/soak.py --minutes 12   # the server inherits it
"""

import argparse
import asyncio
import random
import time

import httpx
from _reliability import FIGURES, ServerProcess

from pagedserve.bench.reliability import (
    parse_metrics,
    random_prompt,
    rss_bytes,
    wait_idle,
)


async def load(url: str, stop_at: float, concurrency: int, seed: int) -> dict[str, int]:
    """Mixed requests from `concurrency` clients until `stop_at` (each request bounded)."""
    rng = random.Random(seed)
    counts = {"ok": 0, "dropped": 0, "errors": 0}

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at:
            kind = rng.choice(("plain", "stream", "n2", "stop", "drop", "chat"))
            body = {"prompt": random_prompt(rng, 40), "max_tokens": rng.randint(4, 48),
                    "temperature": 0.8}
            try:
                if kind == "chat":
                    r = await client.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": body["prompt"]}],
                        "max_tokens": body["max_tokens"]})
                    counts["ok" if r.status_code == 200 else "errors"] += 1
                elif kind in ("stream", "drop"):
                    async with client.stream("POST", "/v1/completions",
                                             json={**body, "stream": True}) as resp:
                        n = 0
                        async for line in resp.aiter_lines():
                            n += line.startswith("data: ")
                            if kind == "drop" and n >= 3:
                                break
                    counts["dropped" if kind == "drop" else "ok"] += 1
                else:
                    if kind == "n2":
                        body["n"] = 2
                    if kind == "stop":
                        body["stop"] = ["the", "\n"]
                    r = await client.post("/v1/completions", json=body)
                    counts["ok" if r.status_code == 200 else "errors"] += 1
            except httpx.HTTPError:
                counts["errors"] += 1

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup-fraction", type=float, default=0.25)
    p.add_argument("--model", default=None, help="default: the embedded model")
    p.add_argument("--plot", default=None, help="default: docs/figures/soak.png")
    p.add_argument("--server-args", default="",
                   help="more server flags, e.g. '--kv-cache-memory 134217728'")
    args = p.parse_args()
    import tempfile
    from pathlib import Path

    flags = ["--max-model-len", "512", "--enable-debug-endpoints", "--disable-access-log",
             "--log-stats-interval", "0", "--max-num-seqs", "16", *args.server_args.split()]
    server = ServerProcess.start(args.model, *flags, log_dir=Path(tempfile.mkdtemp()),
                                 timeout=600)
    samples = []  # (seconds, rss MiB, kv usage)
    try:
        t0 = time.monotonic()
        stop_at = t0 + args.minutes * 60

        async def run() -> dict[str, int]:
            task = asyncio.ensure_future(load(server.url, stop_at, args.concurrency, 0))
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as mc:
                while not task.done():
                    m = parse_metrics((await mc.get("/metrics")).text)
                    samples.append((time.monotonic() - t0, rss_bytes(server.proc.pid) / 2**20,
                                    m.get("pagedserve:kv_cache_usage_perc", 0.0)))
                    await asyncio.sleep(args.interval)
            return await task

        counts = asyncio.run(run())
        state = asyncio.run(wait_idle(server.url))
    finally:
        server.stop()
    warm = [s for s in samples if s[0] >= args.warmup_fraction * args.minutes * 60]
    growth = warm[-1][1] - warm[0][1] if len(warm) > 1 else 0.0
    print(f"{args.minutes:g} min, requests {counts}; RSS {samples[0][1]:.0f} -> "
          f"{samples[-1][1]:.0f} MiB; growth after warm-up ({warm[0][0]:.0f} s) "
          f"{growth:+.1f} MiB; afterwards used blocks {state['used_blocks']}, invariants ok "
          f"{state['invariants_ok']}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ts = [s[0] for s in samples]
    ax.plot(ts, [s[1] for s in samples], color="#4c72b0", label="server RSS (MiB)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MiB)")
    ax.axvline(warm[0][0], color="grey", linestyle=":", label="end of warm-up")
    ax2 = ax.twinx()
    ax2.plot(ts, [100 * s[2] for s in samples], color="#dd8452", alpha=0.6,
             label="KV blocks in use (%)")
    ax2.set_ylabel("KV in use (%)")
    ax2.set_ylim(0, 100)
    ax.set_title(f"Soak ({args.minutes:g} min): RSS growth after warm-up {growth:+.1f} MiB")
    fig.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    plot = Path(args.plot) if args.plot else FIGURES / "soak.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot, dpi=110)
    print(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
