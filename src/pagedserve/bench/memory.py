"""`pagedserve bench memory`: the paper's two memory figures in kind, on the real scheduler and
block managers.

(1) KV memory usage breakdown (the paper's Fig. 2). Seeded length traces (ShareGPT-like and
Alpaca-like) run through the engine's `Scheduler` (the same admission, chunked prefill and
preemption policy as `bench paper` and serving, with the engine's default limits but a token
budget of the whole pool, so that memory alone bounds the batch) over a fixed pool of KV
blocks, for
    - paged: our `KVCacheManager` (blocks grow on demand; when one is missing the latest running
      request is preempted and recomputed), and
    - the Orca-style contiguous managers of `bench.contiguous`, which reserve at admission one
      first-fit run of blocks: `max_model_len` (Max), the prompt plus the next power of two of
      the output length (Pow2) or exactly prompt + output (Oracle).
No model runs: every scheduled sequence gets one (dummy) token per step, so only lengths drive
the allocators and the command is fast and deterministic. Every slot of "used" memory is put in
exactly one category: token states (filled), reservation (reserved, filled later by this
request), internal fragmentation (reserved, never filled because the request ends first) and
external fragmentation (free gaps smaller than the reservation of the request waiting at the head
of the queue). For paged, reservation and internal fragmentation are the empty slots of last
blocks. Shares are averaged over the steps at which >= `busy_threshold` of the pool is used.

(4) KV layer groups (issue 36; `--kv-groups`, or `--only-groups` alone): a trace of long prompts (default 8 requests of 8192 prompt and 256
output tokens) on the model's own layer groups (sliding-window and full attention, latent
attention: core/kv_spec.py) over a pool of `--kv-cache-memory` bytes, and on one group of full
attention (`disable_hybrid_kv_cache_manager`, what the cache did before groups): the blocks,
vLLM's "maximum concurrency" at `max_model_len`, the sequences held at once (peak and mean
running), and per group its mean share of the pool and its waste (held slots no query reads).
The model's layers are read from its config (built on the meta device: no weights).

(2) Sharing savings (the paper's Fig. 15): parallel sampling on the same scheduler (each
request's prompt is computed once and forked to n sequences that grow on their own, copy-on-write
of a shared partial last block on their first write), and beam search on the real engine (which
beams survive depends on the model's scores), versus the same sequences allocated independently.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pagedserve.bench.contiguous import (
    CONTIGUOUS_POLICIES,
    ContiguousKVCacheManager,
    reservation_tokens,
)
from pagedserve.bench.memory_paper import (  # noqa: F401 (re-exported)
    CATEGORIES,
    LABELS,
    PAPER_BEAM_SAVINGS,
    PAPER_PARALLEL_SAVINGS,
    PAPER_TOKEN_SHARE,
)
from pagedserve.bench.memory_plots import plot_breakdown, plot_sharing
from pagedserve.bench.trace import lognormal_lengths
from pagedserve.config import EngineArgs
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus

ALLOCATORS = ("paged",) + CONTIGUOUS_POLICIES

# (mean input, mean output) of the paper's workloads; sigmas as in `bench.trace`.
TRACES = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}
DEFAULT_REQUESTS = {"sharegpt": 600, "alpaca": 2000}
_TRACE_SEED_OFFSET = {"sharegpt": 0, "alpaca": 1000}



@dataclass(frozen=True)
class LengthRequest:
    """A request of a length trace: prompt tokens and tokens to generate."""

    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def length_trace(name: str, num_requests: int, seed: int = 0,
                 max_model_len: int = 2048, scale: float = 1.0) -> list[LengthRequest]:
    """Seeded lognormal lengths of the named workload (`sharegpt` or `alpaca`), with both means
    multiplied by `scale` (1: the paper's workload).

    Prompts and outputs are each clipped to half of `max_model_len`, so every request fits it.
    """
    if name not in TRACES:
        raise ValueError(f"unknown trace {name!r}; choose from {sorted(TRACES)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if max_model_len < 4:
        raise ValueError(f"max_model_len must be >= 4, got {max_model_len}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    mean_in, mean_out = TRACES[name]
    mean_in, mean_out = mean_in * scale, mean_out * scale
    rng = random.Random(seed + _TRACE_SEED_OFFSET[name])
    half = max_model_len // 2
    ins = lognormal_lengths(rng, num_requests, mean_in, 0.8, 1, half)
    outs = lognormal_lengths(rng, num_requests, mean_out, 1.0, 1, half)
    return [LengthRequest(p, o) for p, o in zip(ins, outs)]


# --- accounting ------------------------------------------------------------------------------


@dataclass
class Breakdown:
    """Per-category shares of used KV memory, summed over busy steps (divide by `steps`)."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    steps: int = 0

    def add(self, token: int, reserved: int, internal: int, external: int) -> None:
        """Add one step's slot counts; they are normalised by their own total."""
        total = token + reserved + internal + external
        if total <= 0:
            return
        for name, value in zip(CATEGORIES, (token, reserved, internal, external)):
            self.sums[name] += value / total
        self.steps += 1

    def shares(self) -> dict[str, float]:
        """Mean share of each category over the counted steps (they sum to 1)."""
        if self.steps == 0:
            raise ValueError("no step reached the busy threshold; use a smaller pool or more "
                             "requests")
        return {name: s / self.steps for name, s in self.sums.items()}


def _slot_categories(reserved_slots: int, filled: int, final: int) -> tuple[int, int, int]:
    """(token states, reservation, internal fragmentation) of one sequence's reservation."""
    will_fill = min(reserved_slots, final)
    return filled, will_fill - filled, reserved_slots - will_fill


@dataclass
class SimResult:
    """What one simulation measured."""

    breakdown: Breakdown
    steps: int = 0
    preemptions: int = 0
    cow_copies: int = 0
    used_block_steps: int = 0      # sum over steps of blocks in use (shared counted once)
    unshared_block_steps: int = 0  # sum over steps of blocks the same sequences need unshared
    final_free_slots: int = 0      # free slots (free blocks x block size) after the run

    @property
    def sharing_savings(self) -> float:
        """Blocks saved by sharing / blocks needed without it, over the whole run."""
        if self.unshared_block_steps == 0:
            return 0.0
        return 1.0 - self.used_block_steps / self.unshared_block_steps


# --- the simulation: the real scheduler, lengths only ----------------------------------------


def scheduler_for(kv: KVCacheManager, max_model_len: int) -> Scheduler:
    """The engine's scheduler with its default limits, recompute preemption (no swap pool) and a
    token budget of the whole pool: memory, not compute, bounds every step."""
    args = EngineArgs(preemption_mode="recompute", enable_prefix_caching=False,
                      max_num_batched_tokens=max(2048, kv.num_blocks * kv.block_size))
    return Scheduler(args.scheduler_config(max_model_len), kv)


def simulate(requests: list[LengthRequest], kv: KVCacheManager, n: int = 1,
             max_model_len: int = 2048, busy_threshold: float = 0.9) -> SimResult:
    """Run the trace (every request waiting at step 0, in order) through the engine's scheduler
    over `kv`, with `n` sampled sequences per request, and measure memory at every step."""
    _check_common(requests, kv.num_blocks * kv.block_size, busy_threshold)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max(r.total_len for r in requests) > max_model_len:
        raise ValueError(f"a request is longer than max_model_len={max_model_len}")
    worst = max(n * cdiv(r.total_len, kv.block_size) for r in requests)
    if worst > kv.num_blocks:
        raise ValueError(f"a request with n={n} samples needs {worst} blocks; the pool has "
                         f"{kv.num_blocks}")
    sched = scheduler_for(kv, max_model_len)
    seq_ids = iter(range(n * len(requests)))
    totals: dict[int, int] = {}  # seq id -> prompt + output length
    for i, req in enumerate(requests):
        params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0,
                                max_tokens=req.output_len, ignore_eos=True)
        kv.check_request(n, False, req.prompt_len, req.total_len)
        group = SequenceGroup(str(i), [Sequence(next(seq_ids), [0] * req.prompt_len)
                                       for _ in range(n)], params, arrival_time=float(i))
        group.fork_pending = n > 1
        for seq in group.seqs:
            kv.on_admit(seq.seq_id, req.prompt_len, req.total_len)
            totals[seq.seq_id] = req.total_len
        sched.add(group)
    result = SimResult(Breakdown())
    while sched.has_unfinished():
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError("the scheduler made no progress")
        if out.length_capped:
            raise RuntimeError("a request could not grow even alone in the cache")
        _record(kv, sched, totals, n, busy_threshold, result)
        _advance(sched, out, result)
    result.preemptions = sched.num_preemptions
    kv.check_invariants()
    result.final_free_slots = kv.num_free_blocks * kv.block_size
    if kv.tables or kv.pool.num_used:
        raise RuntimeError(f"leaked {kv.pool.num_used} blocks")
    return result


def _advance(sched: Scheduler, out: SchedulerOutput, result: SimResult) -> None:
    """What the engine does with a step's results, with a dummy token for every sample.

    NOTE: mirrors `LLMEngine.step`'s bookkeeping (computed tokens, forks, appends, length
    finishes); keep the two in step.
    """
    result.steps += 1
    result.cow_copies += len(out.blocks_to_copy)
    for s in out.scheduled:
        s.seq.num_computed_tokens = s.end
        sched.kv.free_out_of_window(s.seq.seq_id, s.end)  # (a sliding-window group's)
        forked = sched.fork_if_ready(s.group)
        if not s.do_sample:
            continue
        for seq in forked if s.num_samples > 1 else [s.seq]:
            seq.append_token(0, 0.0)
            if seq.num_output_tokens >= s.group.sampling_params.max_tokens:
                sched.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                sched.kv.on_finish(seq.seq_id)
    sched.remove_finished()


def _held_blocks(kv: KVCacheManager, seq_id: int) -> int:
    """Blocks a sequence holds: its table's, or its whole reservation under a contiguous manager."""
    reservations = getattr(kv, "reservations", None)
    if reservations is not None:
        return reservations[seq_id][1]
    return len(kv.tables[seq_id].blocks)


def _record(kv: KVCacheManager, sched: Scheduler, totals: dict[int, int], n: int,
            busy_threshold: float, result: SimResult) -> None:
    """Add one step's block counts (after scheduling: this step's slots are allocated); the
    breakdown only when unshared (n == 1: a shared block would count once per holder) and the
    pool is busy."""
    seqs = [q.seq_id for g in sched.running for q in g.unfinished_seqs()]
    result.used_block_steps += kv.pool.num_used  # blocks with reference count > 0
    result.unshared_block_steps += sum(len(kv.block_table(s)) for s in seqs)
    if n > 1:
        return
    bs = kv.block_size
    token = reserved = internal = 0
    for s in seqs:
        t, r, i = _slot_categories(_held_blocks(kv, s) * bs, kv.tables[s].num_tokens, totals[s])
        token, reserved, internal = token + t, reserved + r, internal + i
    external = 0
    if sched.waiting and isinstance(kv, ContiguousKVCacheManager):
        head = sched.waiting[0].seqs[0]
        need = kv.num_new_blocks(head.seq_id, head.num_prompt_tokens)
        external = bs * sum(g for g in kv.ranges.free_gaps() if g < need)
    if token + reserved + internal + external >= busy_threshold * kv.num_blocks * bs:
        result.breakdown.add(token, reserved, internal, external)


def simulate_paged(requests: list[LengthRequest], pool_tokens: int, block_size: int = 16,
                   n: int = 1, busy_threshold: float = 0.9,
                   max_model_len: int = 2048) -> SimResult:
    """`simulate` over `KVCacheManager` with `pool_tokens // block_size` blocks."""
    kv = KVCacheManager(pool_tokens // block_size, block_size)
    return simulate(requests, kv, n, max_model_len, busy_threshold)


def simulate_contiguous(requests: list[LengthRequest], pool_tokens: int, policy: str,
                        max_model_len: int = 2048, busy_threshold: float = 0.9,
                        block_size: int = 16) -> SimResult:
    """`simulate` over a `ContiguousKVCacheManager` of `policy` with `pool_tokens // block_size`
    blocks."""
    kv = ContiguousKVCacheManager(pool_tokens // block_size, block_size, policy, max_model_len)
    return simulate(requests, kv, 1, max_model_len, busy_threshold)


def reservation(policy: str, req: LengthRequest, max_model_len: int) -> int:
    """Slots an Orca-style system reserves for `req` at admission under `policy`."""
    return reservation_tokens(policy, req.prompt_len, req.output_len, max_model_len)


def _check_common(requests: list[LengthRequest], pool_tokens: int, busy_threshold: float):
    if not requests:
        raise ValueError("requests must not be empty")
    if pool_tokens < 1:
        raise ValueError(f"pool_tokens must be >= 1 block, got {pool_tokens}")
    if not 0.0 < busy_threshold <= 1.0:
        raise ValueError(f"busy_threshold must be in (0, 1], got {busy_threshold}")


# --- experiments -----------------------------------------------------------------------------


def memory_breakdown(requests: list[LengthRequest], pool_tokens: int, block_size: int = 16,
                     max_model_len: int = 2048, busy_threshold: float = 0.9):
    """{allocator: SimResult} for the paged manager and every contiguous policy (Fig. 2)."""
    results = {"paged": simulate_paged(requests, pool_tokens, block_size, 1, busy_threshold,
                                       max_model_len)}
    for policy in CONTIGUOUS_POLICIES:
        results[policy] = simulate_contiguous(requests, pool_tokens, policy, max_model_len,
                                              busy_threshold, block_size)
    return results


def parallel_sampling_savings(requests: list[LengthRequest], pool_tokens: int,
                              ns=(2, 4, 6), block_size: int = 16,
                              max_model_len: int = 2048) -> dict[int, SimResult]:
    """{n: SimResult} of parallel sampling with n samples per request (Fig. 15)."""
    return {n: simulate_paged(requests, pool_tokens, block_size, n, max_model_len=max_model_len)
            for n in ns}


def beam_search_savings(llm, requests: list[LengthRequest], width: int, max_tokens: int,
                        seed: int = 0) -> tuple[float, int]:
    """Blocks saved / blocks needed without sharing, summed over the steps of a real beam search
    on the engine (which beams survive depends on the model's scores), and the steps run.

    Prompts are cut from the benchmark corpus at the trace's prompt lengths; outputs are capped
    at `max_tokens` and run with `ignore_eos` so that lengths follow the trace.
    """
    from pagedserve.bench.trace import corpus_text
    from pagedserve.core.beam_search import BeamSearchParams

    engine = llm.engine
    rng = random.Random(seed)
    corpus = engine.tokenizer(corpus_text(), add_special_tokens=False).input_ids
    kv = engine.kv_manager
    for i, req in enumerate(requests):
        start = rng.randrange(0, len(corpus) - req.prompt_len)
        engine.add_beam_request(
            f"beam{width}-{i}", None,
            BeamSearchParams(beam_width=width, max_tokens=max(1, min(req.output_len, max_tokens)),
                             ignore_eos=True),
            prompt_token_ids=corpus[start : start + req.prompt_len])
    shared = unshared = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        for group in engine.scheduler.running:
            tables = [kv.block_table(q.seq_id) for q in group.unfinished_seqs()]
            shared += len({b for t in tables for b in t})
            unshared += sum(len(t) for t in tables)
    if engine.num_used_blocks():
        raise RuntimeError("beam search left KV blocks in use")
    return (1 - shared / unshared if unshared else 0.0), steps


# --- (4) KV layer groups ----------------------------------------------------------------------


@dataclass
class GroupRun:
    """A long-prompt trace on one layout: its blocks, vLLM's maximum concurrency, the sequences
    held at once, and per group (name, mean share of the pool, mean waste of its held slots)
    over the steps with something running."""

    num_blocks: int
    block_bytes: int
    max_concurrency: float
    peak_running: int = 0
    mean_running: float = 0.0
    steps: int = 0
    preemptions: int = 0
    groups: list[tuple[str, float, float]] = field(default_factory=list)


def model_layer_specs(model: str | None) -> tuple:
    """Each layer's KV spec of `model` (None: the embedded Gemma 3 270M), from its config: the
    model is built on the meta device (no weights read or allocated)."""
    import torch

    from pagedserve.models.registry import get_model_class
    from pagedserve.models.source import resolve_model

    config = resolve_model(model).config
    config = getattr(config, "text_config", None) or config
    with torch.device("meta"):
        built = get_model_class(config)(config)
    return built.kv_cache_spec.layer_specs()


def simulate_layout(requests: list[LengthRequest], layout, kv_cache_memory: int,
                    dtype_bytes: int, block_size: int = 16, max_num_batched_tokens: int = 2048,
                    max_model_len: int | None = None) -> GroupRun:
    """The trace (every request waiting at step 0) on the engine's scheduler over a pool of
    `kv_cache_memory` bytes of `layout`'s blocks (the engine's sizing, its null block included),
    chunked prefill at `max_num_batched_tokens` and recompute preemption; one dummy token per
    sampled sequence a step."""
    from pagedserve.worker.kv_cache import max_concurrency  # (torch: only this experiment)

    max_model_len = max_model_len or max(r.total_len for r in requests)
    block_bytes = layout.bytes_per_block(block_size, dtype_bytes)
    num_blocks = kv_cache_memory // block_bytes - 1
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} holds no block of {block_bytes} bytes")
    run = GroupRun(num_blocks, block_bytes, max_concurrency(
        num_blocks, block_size, max_model_len, layout, max_num_batched_tokens))
    kv = KVCacheManager(num_blocks, block_size, layout=layout)
    args = EngineArgs(preemption_mode="recompute", enable_prefix_caching=False,
                      max_num_batched_tokens=max_num_batched_tokens)
    sched = Scheduler(args.scheduler_config(max_model_len), kv)
    for i, req in enumerate(requests):
        if kv.blocks_for(req.total_len - 1, max_num_batched_tokens) > num_blocks:
            raise ValueError(f"request {i} alone needs more than the pool's {num_blocks} blocks")
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0)
        sched.add(SequenceGroup(str(i), [Sequence(i, [0] * req.prompt_len)], params,
                                arrival_time=float(i)))
    sums: dict[str, list[float]] = {}
    running_sum = 0
    result = SimResult(Breakdown())
    while sched.has_unfinished():
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError("the scheduler made no progress")
        running = len(sched.running)
        run.peak_running = max(run.peak_running, running)
        running_sum += running
        for name, blocks, held, live in kv.group_stats():
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0] += blocks / num_blocks
            acc[1] += max(0.0, 1.0 - live / held) if held else 0.0
        _advance(sched, out, result)
    run.steps = result.steps
    run.preemptions = sched.num_preemptions
    run.mean_running = running_sum / max(1, run.steps)
    run.groups = [(name, a / run.steps, b / run.steps) for name, (a, b) in sums.items()]
    kv.check_invariants()
    if kv.tables or kv.pool.num_used:
        raise RuntimeError(f"leaked {kv.pool.num_used} blocks")
    return run


def layer_groups_experiment(model: str | None, dtype_bytes: int, kv_cache_memory: int,
                            prompt_len: int, output_len: int, num_requests: int,
                            block_size: int = 16, max_num_batched_tokens: int = 2048):
    """{"one group" | "layer groups": GroupRun} of the long-prompt trace on `model`'s layers."""
    from pagedserve.core.kv_spec import KVLayout

    specs = model_layer_specs(model)
    reqs = [LengthRequest(prompt_len, output_len)] * num_requests
    return {name: simulate_layout(reqs, KVLayout.from_specs(specs, hybrid), kv_cache_memory,
                                  dtype_bytes, block_size, max_num_batched_tokens)
            for name, hybrid in (("one group", False), ("layer groups", True))}


def _print_layer_groups(args) -> None:
    import torch

    from pagedserve.core.kv_spec import KVLayout

    from pagedserve.attention.kv_dtype import kv_cache_dtype

    dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32, "half": torch.float16, "float": torch.float32}.get(
        args.dtype, torch.bfloat16)
    # the blocks' storage: the model's dtype, or fp8 (--kv-cache-dtype: one byte a value)
    dtype = kv_cache_dtype(getattr(args, "kv_cache_dtype", "auto"), dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    memory = args.kv_cache_memory or (2 << 30)
    p, o, n = args.group_prompt_len, args.group_output_len, args.group_requests
    runs = layer_groups_experiment(args.model, elem, memory, p, o, n, args.block_size,
                                   args.group_batched_tokens)
    layout = KVLayout.from_specs(model_layer_specs(args.model))
    print(f"\n(4) KV layer groups: {n} requests of {p} prompt + {o} output tokens, KV cache "
          f"{memory / 2**20:.0f} MiB of {dtype} ({layout.describe()}), chunks of "
          f"{args.group_batched_tokens} tokens")
    print(f"{'cache':<13} {'blocks':>7} {'KiB/block':>9} {'max conc.':>9} {'peak run':>8} "
          f"{'mean run':>8} {'preempt':>7}   per group: share of the pool (waste)")
    for name, r in runs.items():
        groups = ", ".join(f"{g} {100 * u:.1f}% ({100 * w:.1f}%)" for g, u, w in r.groups)
        print(f"{name:<13} {r.num_blocks:>7} {r.block_bytes / 1024:>9.1f} "
              f"{r.max_concurrency:>9.2f} {r.peak_running:>8} {r.mean_running:>8.2f} "
              f"{r.preemptions:>7}   {groups}")


def add_bench_memory_args(p) -> None:
    """Options of `pagedserve bench memory`; the engine's `--model`, `--dtype`,
    `--kv-cache-dtype` (fp8: (4)'s blocks of half the bytes, and the beam-search engine's
    cache), `--block-size` and `--seed` (the trace's seed too) come from `EngineArgs`."""
    EngineArgs.add_cli_args(p, only=("model", "dtype", "kv_cache_dtype", "block_size", "seed"))
    p.add_argument("--traces", nargs="+", choices=sorted(TRACES), default=["sharegpt", "alpaca"])
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per trace (default: 600 ShareGPT-like, 2000 Alpaca-like)")
    p.add_argument("--pool-tokens", type=int, default=16384,
                   help="KV pool size in token slots (/ block size blocks)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="the simulated engine's max_model_len")
    p.add_argument("--parallel-n", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--busy-threshold", type=float, default=0.9,
                   help="measure the breakdown only at steps with this share of the pool used")
    p.add_argument("--beam-widths", type=int, nargs="*", default=[2, 4, 6],
                   help="beam widths measured on the real engine (none: skip)")
    p.add_argument("--beam-requests", type=int, default=8,
                   help="requests per trace for the beam-search part")
    p.add_argument("--beam-max-tokens", type=int, default=64,
                   help="output cap for the beam-search part (a shortened trace)")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="(4) the KV cache in bytes (default 2 GiB, the engine's CPU default)")
    p.add_argument("--group-prompt-len", type=int, default=8192)
    p.add_argument("--group-output-len", type=int, default=256)
    p.add_argument("--group-requests", type=int, default=8)
    p.add_argument("--group-batched-tokens", type=int, default=2048,
                   help="(4) the token budget of a step (the chunk of a long prompt)")
    p.add_argument("--kv-groups", action="store_true",
                   help="also run (4): the model's KV layer groups on a long-prompt trace")
    p.add_argument("--only-groups", action="store_true",
                   help="run (4), the KV layer groups, alone")
    p.add_argument("--breakdown-plot", default="memory_breakdown.png")
    p.add_argument("--sharing-plot", default="memory_sharing.png")


def _print_breakdown(trace: str, results: dict[str, SimResult]) -> dict[str, dict[str, float]]:
    print(f"{'allocator':<14} {'tokens':>7} {'reserv.':>8} {'int.frag':>9} {'ext.frag':>9} "
          f"{'steps':>6} {'busy':>6} {'preempt':>8}   paper tokens")
    shares = {}
    for name, res in results.items():
        paper = PAPER_TOKEN_SHARE[name] if trace == "sharegpt" else "-"
        if res.breakdown.steps == 0:  # the pool never got busy enough: nothing to average
            cells = f"{'(never >= threshold used)':<37}"
        else:
            shares[name] = res.breakdown.shares()
            cells = " ".join(f"{100 * shares[name][c]:>{w}.1f}%"
                             for c, w in zip(CATEGORIES, (6, 7, 8, 8)))
        print(f"{LABELS[name]:<14} {cells} {res.steps:>6} {res.breakdown.steps:>6} "
              f"{res.preemptions:>8}   {paper}")
    return shares


def main(args) -> int:
    """Run both experiments on every trace, print tables and write the two charts."""
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if any(n < 1 for n in args.parallel_n):
        raise ValueError(f"--parallel-n values must be >= 1, got {args.parallel_n}")
    if args.only_groups:
        _print_layer_groups(args)
        return 0
    traces = {t: length_trace(t, args.num_requests or DEFAULT_REQUESTS[t], args.seed,
                              args.max_model_len) for t in args.traces}
    print(f"KV pool {args.pool_tokens} token slots ({args.pool_tokens // args.block_size} "
          f"blocks of {args.block_size}), max_model_len {args.max_model_len}, "
          f"seed {args.seed}; the engine's scheduler, token budget: the whole pool")
    all_shares, all_savings = {}, {}
    for name, reqs in traces.items():
        mean_in = sum(r.prompt_len for r in reqs) / len(reqs)
        mean_out = sum(r.output_len for r in reqs) / len(reqs)
        print(f"\n(1) KV memory usage breakdown, {name}: {len(reqs)} requests (mean input "
              f"{mean_in:.1f}, "
              f"mean output {mean_out:.1f}); shares averaged over steps with >= "
              f"{100 * args.busy_threshold:.0f}% of the pool used")
        results = memory_breakdown(reqs, args.pool_tokens, args.block_size, args.max_model_len,
                                   args.busy_threshold)
        all_shares[name] = _print_breakdown(name, results)
    print("\n(2) parallel sampling: blocks saved / blocks needed without sharing "
          "(sum over steps)")
    print(f"{'trace':<10} {'n':>3} {'saving':>8} {'CoW copies':>11} {'preempt':>8}   paper")
    for name, reqs in traces.items():
        runs = parallel_sampling_savings(reqs, args.pool_tokens, args.parallel_n,
                                         args.block_size, args.max_model_len)
        all_savings[name] = {n: r.sharing_savings for n, r in runs.items()}
        for n, r in runs.items():
            print(f"{name:<10} {n:>3} {100 * r.sharing_savings:>7.1f}% {r.cow_copies:>11} "
                  f"{r.preemptions:>8}   {PAPER_PARALLEL_SAVINGS.get((name, n), '-')}")
    print("paper (Fig. 15): parallel sampling n = 2..6 saves 6.1%-9.8% on Alpaca, "
          "16.2%-30.5% on ShareGPT")
    if args.beam_widths:
        from pagedserve.engine.llm import LLM

        # (--max-model-len is the simulation's; the engine keeps its model's)
        llm = LLM.from_engine_args(EngineArgs.from_namespace(args, max_model_len=None))
        print(f"\n(3) beam search on the real engine ({llm.engine.source.name}): blocks saved / "
              f"blocks needed without sharing, {args.beam_requests} requests per trace, outputs "
              f"capped at {args.beam_max_tokens} tokens")
        print(f"{'trace':<10} {'width':>5} {'saving':>8} {'steps':>6}   paper")
        for name, reqs in traces.items():
            for width in args.beam_widths:
                saving, steps = beam_search_savings(llm, reqs[: args.beam_requests], width,
                                                    args.beam_max_tokens, args.seed)
                all_savings.setdefault(f"{name} beam", {})[width] = saving
                print(f"{name:<10} {width:>5} {100 * saving:>7.1f}% {steps:>6}   "
                      f"{PAPER_BEAM_SAVINGS.get((name, width), '-')}")
        print("paper (Fig. 15): beam width 2..6 saves 37.6%-55.2% on Alpaca, 44.3%-66.3% on "
              "ShareGPT")
    if args.kv_groups:
        _print_layer_groups(args)
    plot_breakdown(all_shares, args.breakdown_plot)
    plot_sharing(all_savings, args.sharing_plot)
    print(f"charts written to {args.breakdown_plot} and {args.sharing_plot}")
    return 0
