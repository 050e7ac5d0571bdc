"""`pagedserve bench preemption`: the paper's Fig. 19 in kind.

(a) For each block size, the time to swap a set of sequences out and back in versus the time to
recompute them (prefill of the same tokens), on the same model.
(b) End-to-end normalized latency (mean of latency / output length) for each preemption mode on a
trace whose KV budget forces preemption.
"""

from __future__ import annotations

import statistics
import time

import torch

from pagedserve.bench.trace import sharegpt_like_trace
from pagedserve.core.scheduler import PREEMPTION_MODES

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _sync(device: torch.device) -> None:
    from pagedserve.platforms import platform_for

    platform_for(device).synchronize()


def swap_vs_recompute(engine, block_size: int, prompts: list[list[int]], repeats: int = 3):
    """(swap out + in seconds, recompute seconds, blocks moved) for `prompts` at `block_size`."""
    from pagedserve.sampling_params import SamplingParams

    total = sum(len(p) for p in prompts)
    blocks = sum(-(-len(p) // block_size) for p in prompts)
    engine.reconfigure_cache(
        block_size=block_size, num_kv_blocks=blocks + len(prompts) + 1, num_cpu_blocks=blocks,
        preemption_mode="swap", max_num_batched_tokens=max(total, 2048),
        enable_chunked_prefill=True, kv_cache_memory=None,
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    swap_times, recompute_times = [], []
    for r in range(repeats):
        groups = [engine.add_request(f"b{block_size}-{r}-{i}", None, params, prompt_token_ids=p)
                  for i, p in enumerate(prompts)]
        _sync(engine.device)
        t0 = time.perf_counter()
        engine.step()  # prefill of every prompt: what recomputation costs
        _sync(engine.device)
        recompute_times.append(time.perf_counter() - t0)
        seq_ids = [g.seqs[0].seq_id for g in groups]
        kv = engine.kv_manager
        _sync(engine.device)
        t0 = time.perf_counter()
        engine.kv_cache.swap_out(kv.swap_out(seq_ids))
        engine.kv_cache.swap_in(kv.swap_in(seq_ids))
        _sync(engine.device)
        swap_times.append(time.perf_counter() - t0)
        for g in groups:
            engine.abort_request(g.request_id)
    return statistics.median(swap_times), statistics.median(recompute_times), blocks


def normalized_latency(engine, mode: str, trace, num_kv_blocks: int, block_size: int):
    """(mean latency / output length, preemptions by mode, wall seconds) of the whole trace
    arriving at once under a KV budget of `num_kv_blocks`."""
    from pagedserve.sampling_params import SamplingParams

    engine.reconfigure_cache(block_size=block_size, num_kv_blocks=num_kv_blocks,
                             num_cpu_blocks=None, preemption_mode=mode, swap_space=1.0)
    start = time.perf_counter()
    for i, r in enumerate(trace):
        engine.add_request(f"{mode}-{i}", None, SamplingParams(
            temperature=0.0, max_tokens=r.output_len, ignore_eos=True),
            prompt_token_ids=r.prompt_token_ids, arrival_time=time.monotonic())
    per_token = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                m = out.metrics
                per_token.append((m.finished_time - m.arrival_time) / len(out.outputs[0].token_ids))
    wall = time.perf_counter() - start
    return statistics.mean(per_token), dict(engine.scheduler.preemptions_by_mode), wall


def plot(rows, latency, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    sizes = [r[0] for r in rows]
    a.plot(sizes, [r[1] * 1e3 for r in rows], "o-", label="swap out + in")
    a.plot(sizes, [r[2] * 1e3 for r in rows], "s-", label="recompute")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("block size (tokens)")
    a.set_ylabel("time (ms)")
    a.set_title("(a) recovering the same preempted sequences")
    a.legend()
    modes = list(latency)
    b.bar(modes, [latency[m][0] for m in modes])
    b.set_ylabel("normalized latency (s/token)")
    b.set_title("(b) end to end, KV budget forcing preemption")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> int:
    from pagedserve.config import EngineArgs
    from pagedserve.engine.llm import LLM

    llm = LLM.from_engine_args(EngineArgs.from_namespace(args))
    engine = llm.engine
    trace = sharegpt_like_trace(engine.tokenizer, args.num_prompts,
                                input_len_mean=args.input_len_mean,
                                output_len_mean=args.output_len_mean,
                                output_len_fixed=args.output_len_fixed, seed=args.seed,
                                max_input_len=512, max_output_len=512)
    prompts = [r.prompt_token_ids for r in trace[: args.swap_seqs]]
    print(f"model={engine.source.name} dtype={engine.dtype} device={engine.device} "
          f"threads={torch.get_num_threads()}")
    print(f"(a) swap vs recompute of {len(prompts)} sequences, "
          f"{sum(len(p) for p in prompts)} tokens")
    print(f"{'block':>6} {'blocks':>7} {'swap ms':>9} {'recompute ms':>13} {'swap/recompute':>15}")
    swap_vs_recompute(engine, 16, prompts, repeats=1)  # warm-up
    rows = []
    for bs in args.block_sizes:
        swap_s, rec_s, blocks = swap_vs_recompute(engine, bs, prompts)
        rows.append((bs, swap_s, rec_s))
        print(f"{bs:>6} {blocks:>7} {swap_s * 1e3:>9.2f} {rec_s * 1e3:>13.1f} "
              f"{swap_s / rec_s:>15.4f}")
    per_req = max(-(-(len(r.prompt_token_ids) + r.output_len) // 16) for r in trace)
    budget = max(args.kv_blocks or 0, per_req + 1)
    print(f"(b) {len(trace)} requests at once, block size 16, {budget} KV blocks "
          f"(~{budget * 16} tokens) so that preemption is forced")
    latency = {}
    for mode in PREEMPTION_MODES:
        lat, counts, wall = normalized_latency(engine, mode, trace, budget, 16)
        latency[mode] = (lat, counts, wall)
        print(f"{mode:>10}: normalized latency {lat:.4f} s/token, wall {wall:.1f} s, "
              f"preemptions {counts}")
    plot(rows, latency, args.plot)
    print(f"chart written to {args.plot}")
    return 0
