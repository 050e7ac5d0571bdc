"""`pagedserve bench paper`: the paper's headline result in kind (Fig. 12 and Fig. 13).

For each KV allocator (paged, and the Orca-style contiguous baselines of `bench.contiguous`) and
each request rate, a seeded ShareGPT-like or Alpaca-like trace arrives by a Poisson process and
runs through the real engine in this process. Only the memory manager changes between runs: same
model, same model runner, same scheduler, same KV budget and block size. Recorded per point:
normalized latency (mean over requests of end-to-end latency / output tokens), throughput, the
mean and max number of batched requests, and KV memory in token states (held vs reserved).

Scale. On a small CPU a step takes ~0.1 s, so the paper's lengths (ShareGPT: 161 in, 338 out)
would take minutes per request. Every length in tokens is therefore multiplied by one factor
`--length-scale` (per trace by default): the trace's means, `max_model_len` (the paper's 2048)
and the KV budget (the paper's ~15k token states: about 12 GB of KV for OPT-13B on an A100 at
800 KB per token). Request counts per budget, and so every batch-size and reservation ratio, are
those of the paper's setting; with `--length-scale 1` it is the paper's setting itself. The
budget, not compute, bounds the batch: the point of the experiment.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass

from pagedserve.bench.contiguous import KV_ALLOCATORS, kv_manager_factory
from pagedserve.bench.memory import TRACES, length_trace
from pagedserve.bench.plotting import label_panel, panel_row, save_figure
from pagedserve.config import EngineArgs

LABELS = {"paged": "pagedserve", "contiguous-max": "Orca (Max)",
          "contiguous-pow2": "Orca (Pow2)", "contiguous-oracle": "Orca (Oracle)"}
PAPER_MAX_MODEL_LEN = 2048
PAPER_KV_TOKENS = 15360  # ~12 GB of OPT-13B KV (800 KB / token) on a 40 GB A100
DEFAULT_SCALE = {"sharegpt": 0.125, "alpaca": 0.25}
DEFAULT_RATES = {"sharegpt": [0.5, 1.0, 2.0, 3.0, 4.0], "alpaca": [1.0, 2.0, 4.0, 8.0, 12.0]}
# The paper (Sec. 6.2, OPT-13B): vLLM sustains these multiples of Orca's request rate.
PAPER_RATIOS = {"sharegpt": {"contiguous-oracle": "1.7-2.7x", "contiguous-max": "2.7-8x"}}


@dataclass
class PointResult:
    """One (allocator, rate) run."""

    trace: str
    allocator: str
    rate: float
    requests: int
    finished: int
    wall_s: float
    normalized_latency: float  # s / output token, mean over requests (unfinished: lower bound)
    throughput_rps: float
    throughput_tps: float  # output tokens / s
    mean_batch: float  # running requests per step, over steps that ran something
    max_batch: int
    mean_token_states: float  # KV slots holding tokens, per step
    mean_reserved_tokens: float  # KV slots in use (blocks x block size), per step
    capped: bool  # the point hit the wall-clock cap before every request finished

    @property
    def token_share(self) -> float:
        return self.mean_token_states / self.mean_reserved_tokens if self.mean_reserved_tokens \
            else 0.0


@dataclass(frozen=True)
class Setup:
    """The scaled sizes of one trace's sweep."""

    trace: str
    scale: float
    max_model_len: int
    kv_tokens: int
    block_size: int

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_tokens // self.block_size


def make_setup(trace: str, scale: float | None, block_size: int, kv_tokens: int | None) -> Setup:
    """Sizes for `trace` at `scale` (default per trace): max_model_len and KV budget scaled from
    the paper's 2048 and ~15k token states."""
    if trace not in TRACES:
        raise ValueError(f"unknown trace {trace!r}; choose from {sorted(TRACES)}")
    scale = DEFAULT_SCALE[trace] if scale is None else scale
    if not 0 < scale <= 1:
        raise ValueError(f"--length-scale must be in (0, 1], got {scale}")
    max_len = max(16, round(PAPER_MAX_MODEL_LEN * scale))
    kv = kv_tokens or round(PAPER_KV_TOKENS * scale)
    if kv < max_len:
        raise ValueError(f"KV budget of {kv} tokens is less than max_model_len {max_len}")
    return Setup(trace, scale, max_len, kv, block_size)


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process of `rate` requests/s over `duration_s`."""
    if rate <= 0:
        raise ValueError(f"rates must be > 0, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out or [0.0]
        out.append(t)


def run_point(engine, setup: Setup, allocator: str, rate: float, duration_s: float,
              max_point_s: float, seed: int, corpus: list[int], n: int = 1,
              beam_width: int = 0) -> PointResult:
    """Run one Poisson trace through `engine` reconfigured for `allocator`; see the module."""
    from pagedserve.sampling_params import SamplingParams

    engine.reconfigure_cache(kv_manager_factory(allocator), block_size=setup.block_size,
                             num_kv_blocks=setup.num_kv_blocks, kv_cache_memory=None,
                             enable_prefix_caching=False, preemption_mode="recompute",
                             num_cpu_blocks=None)
    arrivals = poisson_arrivals(rate, duration_s, seed)
    lengths = length_trace(setup.trace, len(arrivals), seed, setup.max_model_len, setup.scale)
    rng = random.Random(seed + 1)
    requests = []
    for req in lengths:
        start = rng.randrange(0, len(corpus) - req.prompt_len)
        if beam_width:
            params = SamplingParams(temperature=0.0, n=beam_width, use_beam_search=True,
                                    max_tokens=req.output_len, ignore_eos=True)
        else:
            params = SamplingParams(temperature=1.0 if n > 1 else 0.0, n=n, seed=seed,
                                    max_tokens=req.output_len, ignore_eos=True)
        requests.append((corpus[start : start + req.prompt_len], params, req.output_len))
    kv = engine.kv_manager
    t0 = time.monotonic()
    deadline = t0 + max_point_s
    nxt = 0
    done: dict[str, float] = {}
    batches: list[int] = []
    token_states: list[int] = []
    reserved: list[int] = []
    out_tokens = 0
    while (nxt < len(requests) or engine.has_unfinished_requests()) and time.monotonic() < deadline:
        now = time.monotonic()
        while nxt < len(requests) and t0 + arrivals[nxt] <= now:
            prompt, params, _ = requests[nxt]
            engine.add_request(f"{allocator}-{rate}-{nxt}", None, params,
                               prompt_token_ids=prompt, arrival_time=t0 + arrivals[nxt])
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(t0 + arrivals[nxt] - now, deadline - now)))
            continue
        outputs = engine.step()
        running = len(engine.scheduler.running)
        if running:
            batches.append(running)
            token_states.append(sum(t.num_tokens for t in kv.tables.values()))
            reserved.append(kv.pool.num_used * kv.block_size)
        for out in outputs:
            if out.finished:
                m = out.metrics
                tokens = len(out.outputs[0].token_ids)
                out_tokens += sum(len(o.token_ids) for o in out.outputs)
                done[out.request_id] = (m.finished_time - m.arrival_time) / max(1, tokens)
    wall = time.monotonic() - t0
    capped = len(done) < len(requests)
    per_token = list(done.values())
    if capped:  # lower bounds for the rest: elapsed so far over their full output length
        end = time.monotonic()
        for i in range(nxt):  # requests never added (cap < duration) are left out
            rid = f"{allocator}-{rate}-{i}"
            if rid not in done:
                per_token.append((end - (t0 + arrivals[i])) / requests[i][2])
                engine.abort_request(rid)
    return PointResult(
        trace=setup.trace, allocator=allocator, rate=rate, requests=len(requests),
        finished=len(done), wall_s=wall, normalized_latency=statistics.mean(per_token) if per_token else math.inf,
        throughput_rps=len(done) / wall, throughput_tps=out_tokens / wall,
        mean_batch=statistics.mean(batches) if batches else 0.0,
        max_batch=max(batches, default=0),
        mean_token_states=statistics.mean(token_states) if token_states else 0.0,
        mean_reserved_tokens=statistics.mean(reserved) if reserved else 0.0, capped=capped)


def sustainable_rate(points: list[PointResult], slo: float) -> tuple[float, bool]:
    """The request rate at which normalized latency reaches `slo` (linear between swept rates;
    the last uncapped rate before a capped one), and whether the sweep bounds it (False: latency
    stayed under `slo` at every rate, a lower bound, or the first rate already exceeded it: 0)."""
    # NOTE: a capped point (requests left unfinished) is over any target: its latency is only a
    # lower bound, so it bounds the rate at the previous point.
    pts = sorted(points, key=lambda p: p.rate)
    if not pts or pts[0].capped or pts[0].normalized_latency > slo:
        return 0.0, False
    for a, b in itertools.pairwise(pts):
        if b.capped:
            return a.rate, True
        if b.normalized_latency > slo:
            f = (slo - a.normalized_latency) / (b.normalized_latency - a.normalized_latency)
            return a.rate + f * (b.rate - a.rate), True
    return pts[-1].rate, False


# --- output ----------------------------------------------------------------------------------


def plot_latency(results: dict[str, list[PointResult]], path: str, slo: float | None) -> None:
    """Fig. 12 in kind: normalized latency vs request rate, one line per allocator, per trace."""
    fig, axes = panel_row(len(results), 5.5, 4)
    for ax, (trace, points) in zip(axes, results.items()):
        for alloc in dict.fromkeys(p.allocator for p in points):
            pts = sorted((p for p in points if p.allocator == alloc), key=lambda p: p.rate)
            ax.plot([p.rate for p in pts], [p.normalized_latency for p in pts], "o-",
                    label=LABELS[alloc])
        if slo:
            ax.axhline(slo, color="gray", ls=":", lw=1, label="latency target")
        label_panel(ax, title=f"{trace}-like trace", ylabel="normalized latency (s/token)",
                    xlabel="request rate (req/s)", legend=True)
    save_figure(fig, path)


def plot_batch(results: dict[str, list[PointResult]], path: str) -> None:
    """Fig. 13 in kind: mean batched requests per allocator, at each trace's highest rate."""
    fig, axes = panel_row(len(results), 5, 3.8)
    for ax, (trace, points) in zip(axes, results.items()):
        top = max(p.rate for p in points)
        pts = [p for p in points if p.rate == top]
        ax.bar([LABELS[p.allocator] for p in pts], [p.mean_batch for p in pts], color="#4c72b0")
        for x, p in enumerate(pts):
            ax.text(x, p.mean_batch, f"{p.mean_batch:.1f}", ha="center", va="bottom", fontsize=9)
        label_panel(ax, title=f"{trace}-like, {top:g} req/s", ylabel="# batched requests (mean)")
        ax.tick_params(axis="x", labelsize=8)
    save_figure(fig, path)


def _row(p: PointResult) -> str:
    return (f"{p.trace:<9} {LABELS[p.allocator]:<14} {p.rate:>6.2f} {p.finished:>4}/{p.requests:<4}"
            f" {p.normalized_latency:>9.3f} {p.throughput_rps:>7.2f} {p.throughput_tps:>8.1f}"
            f" {p.mean_batch:>7.1f} {p.max_batch:>5} {p.mean_token_states:>8.0f}"
            f" {p.mean_reserved_tokens:>8.0f} {100 * p.token_share:>6.1f}%"
            f"{'  capped' if p.capped else ''}")


HEADER = (f"{'trace':<9} {'allocator':<14} {'rate':>6} {'done':>9} {'norm.lat':>9} {'req/s':>7}"
          f" {'tok/s':>8} {'batch':>7} {'max':>5} {'tokens':>8} {'reserved':>8} {'share':>7}")


def _rate_text(rate: float, exact: bool) -> str:
    if exact:
        return f"{rate:.2f} req/s"
    return f">= {rate:.2f} req/s (under the target at every rate)" if rate else \
        "over the target at every rate"


def _ratio_text(trace: str, alloc: str, rates: dict[str, tuple[float, bool]]) -> str:
    """paged's sustainable rate over `alloc`'s, when the sweep bounds it, and the paper's."""
    paper = PAPER_RATIOS.get(trace, {}).get(alloc)
    paper = f"   paper: {paper}" if paper else ""
    if "paged" not in rates:
        return paper
    (pr, pexact), (r, exact) = rates["paged"], rates[alloc]
    if exact and r > 0:
        return f"   paged / this: {'' if pexact else '>= '}{pr / r:.2f}x{paper}"
    return f"   paged / this: not bounded by the swept rates{paper}"


def add_bench_paper_args(p) -> None:
    """Options of `pagedserve bench paper`; the engine's `--model`, `--dtype`, `--block-size` and
    `--seed` (the traces' too) come from `EngineArgs`."""
    EngineArgs.add_cli_args(p, only=("model", "dtype", "block_size", "seed"))
    p.add_argument("--trace", nargs="+", choices=sorted(TRACES), default=["sharegpt", "alpaca"])
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="request rates (req/s) to sweep (default: per trace)")
    p.add_argument("--duration-s", type=float, default=30.0,
                   help="seconds of Poisson arrivals per point")
    p.add_argument("--max-point-s", type=float, default=60.0,
                   help="wall-clock cap per point; unfinished requests are then aborted and the "
                        "point is marked capped (their latency is a lower bound)")
    p.add_argument("--allocators", nargs="+", choices=KV_ALLOCATORS, default=list(KV_ALLOCATORS))
    p.add_argument("--n", type=int, default=1, choices=[1, 2, 4, 6],
                   help="parallel samples per request (paged only)")
    p.add_argument("--beam-width", type=int, default=0, choices=[0, 2, 4, 6],
                   help="beam search width (0: off; paged only)")
    p.add_argument("--length-scale", type=float, default=None,
                   help="factor on every length: trace means, max_model_len (2048) and KV budget "
                        f"(~{PAPER_KV_TOKENS} tokens) (default: {DEFAULT_SCALE})")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV budget in token states (default: the scaled paper budget)")
    p.add_argument("--latency-slo", type=float, default=None,
                   help="normalized latency (s/token) at which sustainable rates are compared "
                        "(default: 3x paged's latency at the lowest rate)")
    p.add_argument("--merge", nargs="+", default=None, metavar="RESULTS_JSON",
                   help="add the points of earlier runs (their results.json) to the summary "
                        "and charts, e.g. to extend a sweep to more rates")
    p.add_argument("--output-dir", default="bench_paper",
                   help="folder for results.json, the table and the two PNG charts")


def main(args) -> int:
    """Sweep allocators x rates per trace; print and write the table, JSON and charts."""
    from pagedserve.bench.trace import corpus_text
    from pagedserve.engine.llm import LLM

    if (args.n > 1 or args.beam_width) and any(a != "paged" for a in args.allocators):
        raise ValueError("--n > 1 and --beam-width need block sharing: only --allocators paged "
                         "supports them (the contiguous baselines refuse them)")
    if args.duration_s <= 0 or args.max_point_s <= 0:
        raise ValueError("--duration-s and --max-point-s must be > 0")
    os.makedirs(args.output_dir, exist_ok=True)
    logging.getLogger("pagedserve").setLevel(logging.WARNING)
    results: dict[str, list[PointResult]] = {}
    lines = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    for trace in args.trace:
        setup = make_setup(trace, args.length_scale, args.block_size, args.kv_tokens)
        llm = LLM.from_engine_args(EngineArgs.from_namespace(
            args, max_model_len=setup.max_model_len, num_kv_blocks=setup.num_kv_blocks,
            enable_prefix_caching=False, preemption_mode="recompute"))
        engine = llm.engine
        corpus = engine.tokenizer(corpus_text(), add_special_tokens=False).input_ids
        mean_in, mean_out = (round(m * setup.scale, 1) for m in TRACES[trace])
        say(f"{trace}: model {engine.source.name} ({engine.dtype}, {engine.device}), length scale "
            f"{setup.scale:g}: mean input {mean_in}, mean output {mean_out}, max_model_len "
            f"{setup.max_model_len}, KV budget {setup.kv_tokens} tokens ({setup.num_kv_blocks} "
            f"blocks of {setup.block_size}), {args.duration_s:g} s of arrivals per point "
            f"(cap {args.max_point_s:g} s), n={args.n}, beam width {args.beam_width}")
        say(HEADER)
        # Warm-up (first-call costs) outside the measurement.
        run_point(engine, setup, "paged", 4.0, 1.0, 10.0, args.seed, corpus)
        points = []
        for alloc in args.allocators:
            for rate in (args.rates or DEFAULT_RATES[trace]):
                p = run_point(engine, setup, alloc, rate, args.duration_s, args.max_point_s,
                              args.seed, corpus, args.n, args.beam_width)
                points.append(p)
                say(_row(p))
        results[trace] = points
        engine.shutdown()
        del llm, engine
    for path in args.merge or []:
        # Points of an earlier run (its results.json): this run's points win on the same
        # (trace, allocator, rate); the summary and the charts cover the union.
        with open(path) as f:
            earlier = [PointResult(**d) for d in json.load(f)]
        for p in earlier:
            mine = results.setdefault(p.trace, [])
            if not any(q.allocator == p.allocator and q.rate == p.rate for q in mine):
                mine.append(p)
                say(_row(p) + "   (from " + path + ")")
    for points in results.values():
        points.sort(key=lambda p: (list(KV_ALLOCATORS).index(p.allocator), p.rate))
    say()
    slo_arg = args.latency_slo
    for trace, points in results.items():
        paged = sorted((p for p in points if p.allocator == "paged"), key=lambda p: p.rate)
        slo = slo_arg or (3 * paged[0].normalized_latency
                          if paged and not paged[0].capped else math.inf)
        say(f"{trace}: sustainable request rate at normalized latency <= {slo:.3f} s/token")
        rates = {a: sustainable_rate([p for p in points if p.allocator == a], slo)
                 for a in args.allocators}
        for alloc, (rate, exact) in rates.items():
            say(f"  {LABELS[alloc]:<14} {_rate_text(rate, exact)}"
                + ("" if alloc == "paged" else _ratio_text(trace, alloc, rates)))
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump([asdict(p) for ps in results.values() for p in ps], f, indent=1)
    with open(os.path.join(args.output_dir, "table.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot_latency(results, os.path.join(args.output_dir, "normalized_latency.png"), slo_arg)
    plot_batch(results, os.path.join(args.output_dir, "batch_size.png"))
    print(f"results, table and charts written to {args.output_dir}/")
    return 0
