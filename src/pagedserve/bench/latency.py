"""`pagedserve bench latency`: one fixed batch, end to end (as vLLM's benchmark_latency).

`--batch-size B` random-token prompts of `--input-len I` tokens each generate `--output-len O`
tokens (greedy, ignore_eos) in one `generate` call, `--num-iters` times after `--num-iters-warmup`
warm-up runs. Reported: end-to-end latency (mean and percentiles), the prefill time (a run with
max_tokens=1), and the decode phase: (latency - prefill) over O - 1 steps, as step time and
tokens/s.

The roofline report sets the decode step beside two bounds: the memory-bandwidth bound (every
weight byte read once per step: `weight_bytes / --bandwidth`, default 4.8e12 B/s, an H200) and
the compute bound (2 FLOPs per parameter per token: `2 * params * B / step`, against
`--peak-tflops`, default 790, the H200's dense bf16).

`--profile-kernels N` then runs the batch once more for N tokens and prints the top operators and
kernels of its N - 1 decode steps (the prefill runs unprofiled) by self time on the device (CUDA
kernels on a GPU, ops on CPU) from torch.profiler: where a missed roofline target goes.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import numpy as np


def add_bench_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--bandwidth", type=float, default=4.8e12,
                   help="memory bandwidth in B/s for the roofline (default: H200, 4.8 TB/s)")
    p.add_argument("--peak-tflops", type=float, default=790.0,
                   help="peak dense TFLOP/s for the roofline (default: H200 bf16, 790)")
    p.add_argument("--no-roofline", action="store_true", help="skip the roofline report")
    p.add_argument("--profile-kernels", type=int, default=0, metavar="N",
                   help="after the timed runs, profile the decode steps of one run of N output "
                        "tokens (N >= 2) with torch.profiler and print the top kernels by self "
                        "time (0: off)")


@dataclass
class LatencyResult:
    batch_size: int
    input_len: int
    output_len: int
    latencies: list[float]  # seconds per run
    prefill_s: float  # mean of the max_tokens=1 runs

    @property
    def mean_s(self) -> float:
        return float(np.mean(self.latencies))

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies, q))

    @property
    def decode_step_s(self) -> float:
        """Seconds per decode step (one token for every sequence of the batch)."""
        steps = max(self.output_len - 1, 1)
        return max(self.mean_s - self.prefill_s, 0.0) / steps

    @property
    def decode_tokens_per_s(self) -> float:
        step = self.decode_step_s
        return self.batch_size / step if step > 0 else float("inf")

    def lines(self) -> list[str]:
        return [
            (f"batch {self.batch_size}, input {self.input_len}, output {self.output_len}: "
             f"{len(self.latencies)} runs"),
            (f"  latency: mean {self.mean_s * 1e3:.1f} ms, p50 {self.percentile(50) * 1e3:.1f} ms, "
             f"p90 {self.percentile(90) * 1e3:.1f} ms, p99 {self.percentile(99) * 1e3:.1f} ms"),
            (f"  prefill: {self.prefill_s * 1e3:.1f} ms "
             f"({self.batch_size * self.input_len / max(self.prefill_s, 1e-9):.0f} prompt tok/s)"),
            (f"  decode: {self.decode_step_s * 1e3:.3f} ms/step, "
             f"{self.decode_tokens_per_s:.1f} tok/s"),
        ]


@dataclass(frozen=True)
class Roofline:
    """The decode step against the bandwidth and compute bounds (see the module docstring)."""

    num_params: int
    weight_bytes: int
    batch_size: int
    step_s: float
    bandwidth: float  # B/s
    peak_tflops: float

    @property
    def bandwidth_bound_s(self) -> float:
        return self.weight_bytes / self.bandwidth

    @property
    def bandwidth_fraction(self) -> float:
        """bound / measured: 1.0 is a step at the memory roofline."""
        return self.bandwidth_bound_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def achieved_tflops(self) -> float:
        return 2.0 * self.num_params * self.batch_size / self.step_s / 1e12 if self.step_s > 0 else 0.0

    @property
    def compute_fraction(self) -> float:
        return self.achieved_tflops / self.peak_tflops

    def lines(self) -> list[str]:
        return [
            (f"  roofline: {self.num_params / 1e9:.4g} B params read per step, "
             f"{self.weight_bytes / 1e9:.4g} GB of weights"),
            (f"    decode step {self.step_s * 1e3:.4g} ms vs bandwidth bound "
             f"{self.bandwidth_bound_s * 1e3:.4g} ms at {self.bandwidth / 1e12:.3g} TB/s: "
             f"{100 * self.bandwidth_fraction:.3g}% of the bandwidth roofline"),
            (f"    achieved {self.achieved_tflops:.4g} TFLOP/s of {self.peak_tflops:.4g} peak: "
             f"{100 * self.compute_fraction:.3g}% of peak"),
        ]


def model_sizes(model, tied_embeddings: bool = False) -> tuple[int, int]:
    """(parameters, bytes) a decode step reads and multiplies by, of a model in this process:
    every parameter but the embedding tables (a lookup reads B rows of them), unless the input
    embedding is also the output projection (`tied_embeddings`), which reads it whole."""
    from torch import nn

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    params = [p for p in model.parameters() if id(p) not in embeddings]
    if tied_embeddings:
        first = next((m.weight for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if first is not None and all(p is not first for p in params):
            params.append(first)
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def random_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    # NOTE: ids from the low 3/4 of the vocabulary and never 0..3, away from special tokens.
    hi = max(5, vocab_size * 3 // 4)
    return [{"prompt_token_ids": [rng.randrange(4, hi) for _ in range(input_len)]}
            for _ in range(batch_size)]


def run_latency(llm, *, batch_size: int, input_len: int, output_len: int, num_iters: int,
                num_iters_warmup: int, seed: int = 0) -> LatencyResult:
    """Time `num_iters` runs of one batch (after warm-up), and as many prefill-only runs."""
    from pagedserve.sampling_params import SamplingParams

    if min(batch_size, input_len, output_len, num_iters) < 1 or num_iters_warmup < 0:
        raise ValueError("--batch-size, --input-len, --output-len and --num-iters must be >= 1, "
                         "--num-iters-warmup >= 0")
    engine = llm.engine
    prompts = random_prompts(batch_size, input_len, engine.vocab_size, seed)
    full = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def timed(params) -> float:
        _sync(engine)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync(engine)
        elapsed = time.perf_counter() - start
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        if got != batch_size * params.max_tokens:
            raise RuntimeError(f"expected {batch_size * params.max_tokens} tokens, got {got}")
        return elapsed

    # NOTE: prefix caching would turn every run after the first into a cache hit: it is off
    # for this benchmark (the caller builds the engine so), as in vLLM's.
    for _ in range(num_iters_warmup):
        timed(full)
        timed(first)
    latencies = [timed(full) for _ in range(num_iters)]
    prefill = float(np.mean([timed(first) for _ in range(num_iters)]))
    return LatencyResult(batch_size, input_len, output_len, latencies, prefill)


def kernel_profile(llm, *, batch_size: int, input_len: int, output_len: int, seed: int = 0,
                   rows: int = 15) -> str:
    """The batch's decode steps under torch.profiler (its prompts run first, unprofiled): the
    table of the `rows` operators and kernels with the most self time on the engine's device
    (CUDA time on a GPU, CPU time otherwise) over the `output_len - 1` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    from pagedserve.sampling_params import SamplingParams

    if min(batch_size, input_len, rows) < 1 or output_len < 2:
        raise ValueError("--profile-kernels needs a batch and at least 2 output tokens")
    engine = llm.engine
    cuda = not engine.platform.is_host  # a GPU: its kernels' time, not the host's
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch_size, input_len, engine.vocab_size, seed)):
        engine.add_request(f"kernel-profile-{i}", None, params,
                           prompt_token_ids=prompt["prompt_token_ids"])
    started: set[str] = set()
    while len(started) < batch_size:  # the prompts (prefill), not profiled
        started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(engine)
    with profile(activities=activities) as prof:
        while engine.has_unfinished_requests():
            engine.step()
        _sync(engine)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def _sync(engine) -> None:
    engine.platform.synchronize()


def main(args: argparse.Namespace) -> int:
    from pagedserve.config import EngineArgs
    from pagedserve.engine.llm import LLM

    # One batch: its size (and CUDA graphs up to it), its length, all its prompts in one step.
    sizes = {"max_num_seqs": args.batch_size, "max_model_len": args.input_len + args.output_len,
             "max_num_batched_tokens": max(2048, args.batch_size * args.input_len)}
    overrides = {k: v for k, v in sizes.items() if getattr(args, k, None) is None}
    llm = LLM.from_engine_args(EngineArgs.from_namespace(args, enable_prefix_caching=False,
                                                         **overrides))
    engine = llm.engine
    print(f"model {engine.source.name}, dtype {engine.dtype}, device {engine.device}, "
          f"{engine.num_kv_blocks} KV blocks of {engine.args.block_size}")
    result = run_latency(llm, batch_size=args.batch_size, input_len=args.input_len,
                         output_len=args.output_len, num_iters=args.num_iters,
                         num_iters_warmup=args.num_iters_warmup, seed=args.seed)
    for line in result.lines():
        print(line)
    if not args.no_roofline:
        if engine.model is None:
            print("  roofline: skipped (the model lives in worker processes)")
        else:
            tied = bool(getattr(engine.model_config, "tie_word_embeddings", False))
            params, weight_bytes = model_sizes(engine.model, tied)
            roof = Roofline(params, weight_bytes, args.batch_size, result.decode_step_s,
                            args.bandwidth, args.peak_tflops)
            for line in roof.lines():
                print(line)
    if args.profile_kernels > 0:
        print(f"kernel profile: batch {args.batch_size}, input {args.input_len}, the "
              f"{args.profile_kernels - 1} decode steps of {args.profile_kernels} output tokens")
        print(kernel_profile(llm, batch_size=args.batch_size, input_len=args.input_len,
                             output_len=args.profile_kernels, seed=args.seed))
    llm.engine.shutdown()
    return 0
