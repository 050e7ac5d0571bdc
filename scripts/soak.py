"""Soak: the server on the embedded model (or --model) for --minutes under a mixed load
(streaming and not, n > 1, stop strings, clients hanging up), sampling the server's RSS and KV
usage every --interval seconds, and where it goes (GET /debug/memory: the KV pool's resident
pages, the heap, malloc's bytes in use and freed-but-kept); writes docs/figures/soak.png and prints
RSS growth after warm-up, with and without the KV pool, what malloc_trim gives back at the end and
the Python object types that grew (--tracemalloc: the allocation sites too).

    .venv/bin/python scripts/soak.py --minutes 3
    MALLOC_ARENA_MAX=2 .venv/bin/python scripts/soak.py --minutes 12   # the server inherits it
"""

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

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


def memory_parts(mem: dict) -> dict[str, float]:
    """MiB by part from GET /debug/memory: the main heap and anonymous mappings (RSS), and
    glibc malloc's bytes in use, freed-but-kept, and mmapped on their own."""
    malloc = mem.get("malloc") or {}
    smaps = mem["smaps"]
    return {"heap_rss": smaps["heap"] / 2**20, "kv_rss": smaps["kv"] / 2**20,
            "weights_rss": smaps["weights"] / 2**20, "anon_rss": smaps["anon"] / 2**20,
            "malloc_in_use": malloc.get("in_use", 0) / 2**20,
            "malloc_free": malloc.get("free_in_arenas", 0) / 2**20,
            "malloc_mmapped": malloc.get("mmapped", 0) / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--warmup-fraction", type=float, default=0.25)
    p.add_argument("--model", default="gemma-3-270m", help="default: the embedded gemma-3-270m")
    p.add_argument("--plot", default=None, help="default: docs/figures/soak.png")
    p.add_argument("--server-args", default="",
                   help="more server flags, e.g. '--kv-cache-memory 134217728'")
    p.add_argument("--tracemalloc", action="store_true",
                   help="trace Python allocations from the end of warm-up (slows the server)")
    p.add_argument("--json", default=None, help="also write the samples here")
    p.add_argument("--replot", default=None,
                   help="no run: print and plot the run saved by --json in this file")
    args = p.parse_args()
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
    else:
        data = collect(args)
        if args.json:
            Path(args.json).write_text(json.dumps(data))
    report(data, Path(args.plot) if args.plot else FIGURES / "soak.png")
    return 0


def collect(args: argparse.Namespace) -> dict:
    """Serve, load and sample; everything `report` needs (what --json saves)."""
    import tempfile

    flags = ["--max-model-len", "512", "--enable-debug-endpoints", "--disable-access-log",
             "--log-stats-interval", "0", "--max-num-seqs", "16", *args.server_args.split()]
    server = ServerProcess.start(args.model, *flags, log_dir=Path(tempfile.mkdtemp()),
                                 timeout=600)
    samples = []  # (seconds, rss MiB, kv usage, {memory part: MiB})
    marks: dict[str, dict] = {}  # /debug/memory (and tracemalloc) at warm-up end and at the end
    warmup_s = args.warmup_fraction * args.minutes * 60
    try:
        t0 = time.monotonic()
        stop_at = t0 + args.minutes * 60

        async def run() -> dict[str, int]:
            task = asyncio.ensure_future(load(server.url, stop_at, args.concurrency, 0))
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as mc:
                while not task.done():
                    m = parse_metrics((await mc.get("/metrics")).text)
                    mem = (await mc.get("/debug/memory")).json()
                    now = time.monotonic() - t0
                    samples.append((now, rss_bytes(server.proc.pid) / 2**20,
                                    m.get("pagedserve:kv_cache_usage_perc", 0.0),
                                    memory_parts(mem)))
                    if now >= warmup_s and "warm" not in marks:
                        marks["warm"] = (await mc.get("/debug/memory",
                                                      params={"objects": 40})).json()
                        if args.tracemalloc:
                            await mc.post("/debug/tracemalloc/start", params={"frames": 4})
                    await asyncio.sleep(args.interval)
                counts = await task
                marks["end"] = (await mc.get("/debug/memory", params={"objects": 40})).json()
                if args.tracemalloc and "warm" in marks:
                    marks["tracemalloc"] = (await mc.get("/debug/tracemalloc/snapshot",
                                                         params={"top": 15})).json()
            return counts

        counts = asyncio.run(run())
        state = asyncio.run(wait_idle(server.url))
        trim = httpx.post(server.url + "/debug/memory/trim", timeout=60).json()
    finally:
        server.stop()
    return {"args": vars(args), "counts": counts, "samples": samples, "marks": marks,
            "trim": trim, "state": state}


def report(data: dict, plot: Path) -> None:
    """Print the growth after warm-up (with and without the KV pool) and where it went; plot."""
    args = argparse.Namespace(**data["args"])
    samples, marks, counts = data["samples"], data["marks"], data["counts"]
    state, trim = data["state"], data["trim"]
    warmup_s = args.warmup_fraction * args.minutes * 60
    warm = [s for s in samples if s[0] >= warmup_s]
    growth = warm[-1][1] - warm[0][1] if len(warm) > 1 else 0.0
    # The KV pool becomes resident block by block as the prefix cache fills it (bounded by the
    # KV budget, by design); the target is the rest of RSS.
    rest = [s[1] - s[3]["kv_rss"] for s in samples]
    rest_growth = rest[-1] - rest[len(samples) - len(warm)] if len(warm) > 1 else 0.0
    print(f"{args.minutes:g} min, requests {counts}; RSS {samples[0][1]:.0f} -> "
          f"{samples[-1][1]:.0f} MiB; growth after warm-up ({warm[0][0]:.0f} s) "
          f"{growth:+.1f} MiB, without the KV pool {rest_growth:+.1f} MiB; afterwards used "
          f"blocks {state['used_blocks']}, invariants ok {state['invariants_ok']}")
    if len(warm) > 1:
        print("  after warm-up, by part (MiB): " + ", ".join(
            f"{k} {warm[0][3][k]:.0f} -> {warm[-1][3][k]:.0f} "
            f"({warm[-1][3][k] - warm[0][3][k]:+.1f})" for k in warm[0][3]))
    print(f"  malloc_trim(0) when idle at the end: RSS {trim['rss_before'] / 2**20:.0f} -> "
          f"{trim['rss_after'] / 2**20:.0f} MiB")
    if "warm" in marks:
        a, b = marks["warm"].get("objects", {}), marks["end"].get("objects", {})
        grown = sorted(((b.get(k, 0) - a.get(k, 0), k) for k in set(a) | set(b)), reverse=True)
        print("  gc objects grown since warm-up: " + ", ".join(
            f"{k} {d:+d}" for d, k in grown[:8] if d))
        arenas = marks["end"]["malloc"].get("arenas", [])
        print("  malloc arenas at the end (system / free MiB): " + ", ".join(
            f"#{a['nr']} {a['system'] / 2**20:.0f}/{a['free'] / 2**20:.0f}" for a in arenas))
    if "tracemalloc" in marks:
        tm = marks["tracemalloc"]
        print(f"  tracemalloc since warm-up: {tm['traced_growth'] / 2**20:+.2f} MiB traced; top:")
        for site in tm["top"][:8]:
            print(f"    {site['size_diff'] / 1024:+9.1f} KiB {site['count_diff']:+7d} "
                  f"{' <- '.join(site['traceback'][:2])}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    ts = [s[0] for s in samples]
    ax.plot(ts, [s[1] for s in samples], color="#4c72b0", label="server RSS")
    ax.plot(ts, rest, color="#8172b3", label="RSS less the KV pool's")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    for key, color, label in (("kv_rss", "#dd8452", "KV pool resident"),
                              ("malloc_in_use", "#55a868", "malloc in use"),
                              ("malloc_free", "#c44e52", "malloc free, kept")):
        ax.plot(ts, [s[3][key] for s in samples], color=color, linewidth=1, label=label)
    ax.axvline(warm[0][0], color="grey", linestyle=":", label="end of warm-up")
    ax2 = ax.twinx()
    ax2.plot(ts, [100 * s[2] for s in samples], color="grey", alpha=0.35, linewidth=0.8,
             label="KV blocks in use (%, right)")
    ax2.set_ylabel("KV blocks in use (%)")
    ax2.set_ylim(0, 100)
    ax.set_title(f"Soak ({args.minutes:g} min) after warm-up: RSS {growth:+.0f} MiB, "
                 f"without the KV pool {rest_growth:+.0f} MiB", fontsize=10)
    fig.tight_layout(rect=(0, 0.17, 1, 1))
    fig.legend(loc="lower center", ncol=4, fontsize=7.5, frameon=False)
    plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot, dpi=110)
    print(f"wrote {plot}")


if __name__ == "__main__":
    raise SystemExit(main())
