"""Side by side: `pagedserve bench serve` against our server and against llama.cpp's llama-server
on the same weights (the embedded Gemma 3 270M, BF16), one server at a time, in one run.

    ../shared/tools/build-llama-server.sh /tmp/llama.cpp        # once; not part of the repo
    .venv/bin/python scripts/bench_vs_llama_server.py --llama-cpp /tmp/llama.cpp \
        --concurrency 1 16 64 --out /tmp/vs-llama

For each concurrency C: our server with `--dtype bfloat16 --max-num-seqs C`, llama-server with
`-np C -t <threads>` and every request `cache_prompt: false`; the same seeded ShareGPT-like trace
(64 requests, mean input 161 tokens, 128 output tokens, ignore_eos, distinct prompts), at most C
in flight. Records output tokens/s, TTFT/TPOT p50 and the servers' peak resident memory, prints
a table and writes `results.json` in --out. The BF16 GGUF is made from the embedded Q4_K_M file
with llama-quantize (the same values our engine gets by dequantizing).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Server:
    """A server subprocess, its readiness, and its peak RSS sampled every 0.2 s."""

    def __init__(self, cmd: list[str], port: int, log: Path, env: dict | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.peak_rss = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, rss(self.proc.pid))
            time.sleep(0.2)

    def wait_ready(self, timeout: float = 300) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.url} not ready after {timeout} s")

    def stop(self) -> None:
        self._stop.set()
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def bf16_gguf(llama_cpp: Path, out_dir: Path) -> Path:
    from pagedserve.models.embedded import embedded_model_path

    target = out_dir / "gemma3-270m-bf16.gguf"
    if not target.exists():
        subprocess.run([str(llama_cpp / "build" / "bin" / "llama-quantize"), "--allow-requantize",
                        str(embedded_model_path()), str(target), "BF16"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return target


def bench(url: str, concurrency: int, args, out: Path, extra: list[str]) -> dict:
    cmd = [PY, "-m", "pagedserve.entrypoints.cli", "bench", "serve", "--base-url", url,
           "--num-prompts", str(args.num_prompts), "--input-len-mean", str(args.input_len_mean),
           "--output-len-fixed", str(args.output_len), "--max-concurrency", str(concurrency),
           "--result-json", str(out), *extra]
    res = subprocess.run(cmd, capture_output=True, text=True)
    print(res.stdout)
    if res.returncode != 0:
        print(res.stderr[-3000:])
        raise RuntimeError(f"bench serve failed against {url}")
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama.cpp"))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-mean", type=float, default=161.0)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--engines", nargs="+", default=["pagedserve", "llama-server"])
    p.add_argument("--profile", action="store_true", help="our server's per-section profile")
    p.add_argument("--pagedserve-args", default="", help="extra flags for our server")
    p.add_argument("--out", type=Path, default=Path("/tmp/vs-llama"))
    p.add_argument("--request-body", type=json.loads, default={},
                   help='JSON fields added to every request of both engines, e.g. sampling: '
                        '\'{"temperature": 1.0, "top_p": 0.95}\' (default: greedy)')
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = bf16_gguf(args.llama_cpp, args.out) if "llama-server" in args.engines else None

    rows = []
    for c in args.concurrency:
        for engine in args.engines:
            port = free_port()
            if engine == "pagedserve":
                cmd = [PY, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port),
                       "--dtype", "bfloat16", "--max-num-seqs", str(max(c, 1)),
                       "--disable-access-log", "--log-stats-interval", "0",
                       "--uvicorn-log-level", "warning", *args.pagedserve_args.split()]
                extra = ["--extra-body", json.dumps(args.request_body)] if args.request_body else []
                if args.profile:
                    cmd.append("--enable-debug-endpoints")
                    extra.append("--profile")
            else:
                slot_ctx = 1024 + args.output_len + 64
                cmd = [str(args.llama_cpp / "build" / "bin" / "llama-server"), "-m", str(gguf),
                       "--host", "127.0.0.1", "--port", str(port), "-np", str(c),
                       "-c", str(c * slot_ctx), "-t", str(args.threads), "--no-webui"]
                extra = ["--extra-body", json.dumps({"cache_prompt": False, **args.request_body}),
                         "--served-model-name", "gemma3"]
            server = Server(cmd, port, args.out / f"{engine}-c{c}.log")
            try:
                server.wait_ready()
                idle_rss = rss(server.proc.pid)
                result = bench(server.url, c, args, args.out / f"{engine}-c{c}.json", extra)
            finally:
                server.stop()
            result.update(engine=engine, concurrency=c, peak_rss_mib=server.peak_rss / 2**20,
                          idle_rss_mib=idle_rss / 2**20)
            rows.append(result)
            print(f"{engine} C={c}: {result['output_throughput']:.1f} tok/s, TTFT p50 "
                  f"{result['ttft_p50_ms']:.0f} ms, peak RSS {result['peak_rss_mib']:.0f} MiB",
                  flush=True)

    (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    print(f"\n{'engine':<13}{'C':>4}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}"
          f"{'peak RSS':>10}")
    for r in rows:
        print(f"{r['engine']:<13}{r['concurrency']:>4}{r['output_throughput']:>11.1f}"
              f"{r['ttft_p50_ms']:>8.0f}ms{r['tpot_p50_ms']:>8.1f}ms{r['peak_rss_mib']:>7.0f}MiB")
    for c in args.concurrency:
        ours = [r for r in rows if r["engine"] == "pagedserve" and r["concurrency"] == c]
        peer = [r for r in rows if r["engine"] == "llama-server" and r["concurrency"] == c]
        if ours and peer:
            print(f"C={c}: pagedserve / llama-server output tok/s = "
                  f"{ours[0]['output_throughput'] / peer[0]['output_throughput']:.2f}x, "
                  f"TTFT p50 {ours[0]['ttft_p50_ms']:.0f} vs {peer[0]['ttft_p50_ms']:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
