"""`pagedserve bench memory`: the paper's two memory figures in kind, on the real block manager.

(1) KV memory usage breakdown (the paper's Fig. 2). Seeded length traces (ShareGPT-like and
Alpaca-like) run through an iteration-level scheduler over a fixed pool of KV token slots, for
    - paged: our `KVCacheManager` (blocks grow on demand, recompute-style preemption of the
      latest request when a block is missing), and
    - Orca-style contiguous allocators that reserve, at admission, one first-fit range of a
      single slot buffer: `max_model_len` slots (Max), the next power of two of the true length
      (Pow2, at most 2x) or exactly the true prompt + output length (Oracle).
The paged scheduler admits strictly FCFS (as vLLM); the contiguous ones let a later request fill
a gap the head does not fit (generous to the baseline). Every slot of "used" memory is put in
exactly one category: token states (filled), reservation (reserved, filled later by this
request), internal fragmentation (reserved, never filled because the request ends first) and
external fragmentation (free gaps that no waiting request fits). For paged, "used" is every block
with reference count > 0, and its reservation / internal fragmentation are the empty slots of
last blocks.
Shares are averaged over the steps at which >= `busy_threshold` of the pool is used.

(2) Sharing savings of parallel sampling (the paper's Fig. 15): each request's prompt is
allocated once and forked to n sequences that grow on their own (copy-on-write of a shared partial
last block on their first write), versus the same sequences allocated independently.
Beam search savings need the real engine and are not part of this command yet.

No model runs: only lengths drive the allocators, so the command is fast and deterministic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pagedserve.bench.trace import lognormal_lengths
from pagedserve.core.contiguous import (
    CONTIGUOUS_POLICIES,
    ContiguousAllocator,
    reservation_tokens,
)
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv

CATEGORIES = ("token states", "reservation", "internal frag", "external frag")
ALLOCATORS = ("paged",) + CONTIGUOUS_POLICIES
LABELS = {"paged": "pagedserve", "max": "Orca (Max)", "pow2": "Orca (Pow2)",
          "oracle": "Orca (Oracle)"}

# (mean input, mean output) of the paper's workloads; sigmas as in `bench.trace`.
TRACES = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}
DEFAULT_REQUESTS = {"sharegpt": 600, "alpaca": 2000}
_TRACE_SEED_OFFSET = {"sharegpt": 0, "alpaca": 1000}

# The paper's numbers (token-state share, Fig. 2; parallel-sampling savings, Fig. 15).
PAPER_TOKEN_SHARE = {"paged": "96.3%", "max": "20.4%", "pow2": "20.4-38.2%", "oracle": "38.2%"}
PAPER_PARALLEL_SAVINGS = {("alpaca", 2): "6.1%", ("alpaca", 6): "9.8%",
                          ("sharegpt", 2): "16.2%", ("sharegpt", 6): "30.5%"}


@dataclass(frozen=True)
class LengthRequest:
    """A request of a length trace: prompt tokens and tokens to generate."""

    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


PAPER_BEAM_SAVINGS = {("alpaca", 2): "37.6%", ("alpaca", 6): "55.2%",
                      ("sharegpt", 2): "44.3%", ("sharegpt", 6): "66.3%"}


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
    final_free_slots: int = 0      # free slots (paged: blocks x block size) after the run

    @property
    def sharing_savings(self) -> float:
        """Blocks saved by sharing / blocks needed without it, over the whole run."""
        if self.unshared_block_steps == 0:
            return 0.0
        return 1.0 - self.used_block_steps / self.unshared_block_steps


# --- paged (our block manager) ---------------------------------------------------------------


@dataclass
class _Group:
    """A request's n sequences under the paged simulation; `generated` tokens each so far."""

    req: LengthRequest
    seq_ids: list[int]
    generated: int = 0


def _rebuild_blocks(req: LengthRequest, n: int, generated: int, block_size: int) -> int:
    """Blocks that (re)admitting a group takes: the prompt's full blocks once, the rest per
    sequence (a shared partial prompt block is copied on write by every sample that has written)."""
    if generated == 0:
        return cdiv(req.prompt_len, block_size)
    shared = req.prompt_len // block_size
    return shared + n * (cdiv(req.prompt_len + generated, block_size) - shared)


def _try_admit(kv: KVCacheManager, running: list[_Group], group: _Group, n: int,
               result: SimResult) -> bool:
    """Admit `group` if its blocks are free now."""
    if _rebuild_blocks(group.req, n, group.generated, kv.block_size) > kv.num_free_blocks:
        return False
    _admit(kv, group)
    running.append(group)
    return True


def _admit(kv: KVCacheManager, group: _Group) -> None:
    """Allocate the prompt once, fork it to every sample, grow each to its generated length.

    A readmitted group gets the block layout it had when preempted (the copies this makes are
    layout, not copy-on-write traffic of the run, so they are not counted).
    """
    parent, *children = group.seq_ids
    kv.allocate_slots(parent, group.req.prompt_len)
    for child in children:
        kv.fork(parent, child)
    if group.generated:
        # NOTE: children first, parent last: the last holder of a shared partial block writes in
        # place, exactly as on the original run, so `_rebuild_blocks` stays exact.
        for seq in children + [parent]:
            kv.allocate_slots(seq, group.req.prompt_len + group.generated)


def _grow(kv: KVCacheManager, group: _Group, result: SimResult) -> None:
    """One decode step: every sample of the group gains a token slot."""
    length = group.req.prompt_len + group.generated + 1
    for seq in group.seq_ids:
        result.cow_copies += len(kv.allocate_slots(seq, length))
    group.generated += 1


def _decode_step(kv: KVCacheManager, running: list[_Group], waiting: list[_Group],
                 result: SimResult) -> None:
    """Grow running groups in FCFS order; preempt the latest when a block is missing."""
    i = 0
    while i < len(running):
        group = running[i]
        length = group.req.prompt_len + group.generated + 1
        need = sum(kv.num_new_blocks(s, length) for s in group.seq_ids)
        # NOTE: `need` may overcount by the copy a last holder will not make; that only makes
        # preemption slightly early, never lets `allocate_slots` run out.
        if need > kv.num_free_blocks:
            victim = running.pop()
            for seq in victim.seq_ids:
                kv.free(seq)
            waiting.insert(0, victim)
            result.preemptions += 1
            continue  # retry the same group (or stop if it was the victim)
        _grow(kv, group, result)
        i += 1


def _paged_step_stats(kv: KVCacheManager, running: list[_Group]) -> tuple[int, ...]:
    """(token, reservation, internal, external) slots.

    NOTE: counts per table, so it is exact only without sharing (n == 1); a shared block would
    be counted once per holder.
    """
    token = reserved = internal = 0
    for group in running:
        for seq in group.seq_ids:
            table = kv.tables[seq]
            t, r, i = _slot_categories(len(table.blocks) * kv.block_size, table.num_tokens,
                                       group.req.total_len)
            token, reserved, internal = token + t, reserved + r, internal + i
    return token, reserved, internal, 0


def simulate_paged(requests: list[LengthRequest], pool_tokens: int, block_size: int = 16,
                   n: int = 1, busy_threshold: float = 0.9) -> SimResult:
    """Run the trace (all requests waiting at step 0) through `KVCacheManager`.

    Each step: running groups gain a token per sample (FCFS; on a missing block the latest
    running group is preempted and requeued first, keeping its progress), waiting groups are
    admitted strictly FCFS while the head's blocks fit, memory is measured, finished groups are
    freed.
    With `n > 1` each request samples n outputs sharing the prompt's blocks.
    """
    _check_common(requests, pool_tokens, busy_threshold)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    num_blocks = pool_tokens // block_size
    worst = max(n * cdiv(r.total_len, block_size) for r in requests)
    if worst > num_blocks:
        raise ValueError(f"a request with n={n} samples needs {worst} blocks; the pool has "
                         f"{num_blocks}")
    kv = KVCacheManager(num_blocks, block_size)
    result = SimResult(Breakdown())
    waiting = [_Group(r, list(range(i * n, (i + 1) * n))) for i, r in enumerate(requests)]
    running: list[_Group] = []
    while waiting or running:
        _decode_step(kv, running, waiting, result)
        # NOTE: strict FCFS, as vLLM: a free block serves any request, so a head that does not
        # fit waits for memory rather than for a gap, and later requests may not overtake it.
        while waiting and _try_admit(kv, running, waiting[0], n, result):
            waiting.pop(0)
        _record_paged(kv, running, n, busy_threshold, result)
        for group in [g for g in running if g.generated >= g.req.output_len]:
            running.remove(group)
            for seq in group.seq_ids:
                kv.free(seq)
    kv.check_invariants()
    result.final_free_slots = kv.num_free_blocks * block_size
    if kv.tables or kv.num_free_blocks != num_blocks:
        raise RuntimeError(f"leaked {num_blocks - kv.num_free_blocks} blocks")
    return result


def _record_paged(kv: KVCacheManager, running: list[_Group], n: int, busy_threshold: float,
                  result: SimResult) -> None:
    """Add one step's block counts; the breakdown only when unshared and the pool is busy."""
    result.steps += 1
    used = kv.pool.num_used  # blocks with reference count > 0
    result.used_block_steps += used
    result.unshared_block_steps += sum(len(kv.tables[s].blocks)
                                       for g in running for s in g.seq_ids)
    if n == 1 and used >= busy_threshold * kv.num_blocks:
        result.breakdown.add(*_paged_step_stats(kv, running))


# --- contiguous (Orca-style) -----------------------------------------------------------------


def reservation(policy: str, req: LengthRequest, max_model_len: int) -> int:
    """Slots an Orca-style system reserves for `req` at admission under `policy`."""
    return reservation_tokens(policy, req.total_len, max_model_len)


@dataclass
class _Reserved:
    """A running request of the contiguous simulation and its reserved range."""

    req: LengthRequest
    start: int
    size: int
    generated: int = 0


def simulate_contiguous(requests: list[LengthRequest], pool_tokens: int, policy: str,
                        max_model_len: int = 2048, busy_threshold: float = 0.9) -> SimResult:
    """Run the trace through `ContiguousAllocator` with reservations by `policy`.

    Each step: running requests gain a token; each waiting request, in arrival order, is
    admitted when a first-fit range holds its reservation (later requests may fill a gap the
    head does not fit: the most generous policy for the baseline, and the one under which every
    free gap left while requests wait is external fragmentation); memory is measured; finished
    requests are freed.
    """
    _check_common(requests, pool_tokens, busy_threshold)
    sizes = [reservation(policy, r, max_model_len) for r in requests]
    if max(sizes) > pool_tokens:
        raise ValueError(f"a reservation of {max(sizes)} slots exceeds the pool ({pool_tokens})")
    if any(s < r.total_len for s, r in zip(sizes, requests)):
        raise ValueError(f"a request is longer than max_model_len={max_model_len}")
    buf = ContiguousAllocator(pool_tokens)
    result = SimResult(Breakdown())
    waiting = list(zip(requests, sizes))
    smallest = min(sizes)
    running: list[_Reserved] = []
    while waiting or running:
        for r in running:
            r.generated += 1
        # Only scan the queue when some gap could hold its smallest reservation.
        if waiting and buf.largest_gap() >= smallest:
            waiting[:] = [w for w in waiting if not _try_reserve(buf, running, *w)]
            smallest = min((size for _, size in waiting), default=0)
        _record_contiguous(buf, running, smallest if waiting else None, busy_threshold, result)
        for r in [r for r in running if r.generated >= r.req.output_len]:
            running.remove(r)
            buf.free(r.start, r.size)
    result.final_free_slots = buf.num_free
    if buf.free_gaps() != [pool_tokens]:
        raise RuntimeError(f"leaked slots: free ranges {buf.free_gaps()}")
    return result


def _try_reserve(buf: ContiguousAllocator, running: list[_Reserved], req: LengthRequest,
                 size: int) -> bool:
    """Reserve a first-fit range for `req` and run it, if one holds `size` slots."""
    start = buf.allocate(size)
    if start is None:
        return False
    running.append(_Reserved(req, start, size))
    return True


def _record_contiguous(buf: ContiguousAllocator, running: list[_Reserved], smallest: int | None,
                       busy_threshold: float, result: SimResult) -> None:
    """Add one step's breakdown if the pool is busy; `smallest` is the smallest waiting
    reservation (None when nobody waits)."""
    result.steps += 1
    token = reserved = internal = 0
    for r in running:
        t, res, i = _slot_categories(r.size, r.req.prompt_len + r.generated, r.req.total_len)
        token, reserved, internal = token + t, reserved + res, internal + i
    # NOTE: a free gap is external fragmentation when no waiting request fits it; after the
    # in-order admission with overtaking above, that is every gap while any request waits.
    external = sum(g for g in buf.free_gaps() if smallest is not None and g < smallest)
    used = token + reserved + internal + external
    if used >= busy_threshold * buf.num_slots:
        result.breakdown.add(token, reserved, internal, external)


def _check_common(requests: list[LengthRequest], pool_tokens: int, busy_threshold: float):
    if not requests:
        raise ValueError("requests must not be empty")
    if pool_tokens < 1:
        raise ValueError(f"pool_tokens must be >= 1, got {pool_tokens}")
    if not 0.0 < busy_threshold <= 1.0:
        raise ValueError(f"busy_threshold must be in (0, 1], got {busy_threshold}")


# --- experiments -----------------------------------------------------------------------------


def memory_breakdown(requests: list[LengthRequest], pool_tokens: int, block_size: int = 16,
                     max_model_len: int = 2048, busy_threshold: float = 0.9):
    """{allocator: SimResult} for the paged manager and every contiguous policy (Fig. 2)."""
    results = {"paged": simulate_paged(requests, pool_tokens, block_size, 1, busy_threshold)}
    for policy in CONTIGUOUS_POLICIES:
        results[policy] = simulate_contiguous(requests, pool_tokens, policy, max_model_len,
                                              busy_threshold)
    return results


def parallel_sampling_savings(requests: list[LengthRequest], pool_tokens: int,
                              ns=(2, 4, 6), block_size: int = 16) -> dict[int, SimResult]:
    """{n: SimResult} of parallel sampling with n samples per request (Fig. 15)."""
    return {n: simulate_paged(requests, pool_tokens, block_size, n) for n in ns}


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


def add_bench_memory_args(p) -> None:
    """Options of `pagedserve bench memory`."""
    p.add_argument("--traces", nargs="+", choices=sorted(TRACES), default=["sharegpt", "alpaca"])
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per trace (default: 600 ShareGPT-like, 2000 Alpaca-like)")
    p.add_argument("--pool-tokens", type=int, default=16384,
                   help="KV pool size in token slots (paged: / block size blocks)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--parallel-n", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--busy-threshold", type=float, default=0.9,
                   help="measure the breakdown only at steps with this share of the pool used")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--beam-widths", type=int, nargs="*", default=[2, 4, 6],
                   help="beam widths measured on the real engine (none: skip)")
    p.add_argument("--beam-requests", type=int, default=8,
                   help="requests per trace for the beam-search part")
    p.add_argument("--beam-max-tokens", type=int, default=64,
                   help="output cap for the beam-search part (a shortened trace)")
    p.add_argument("--model", default=None, help="model for the beam-search part "
                   "(default: the embedded Gemma 3 270M)")
    p.add_argument("--dtype", default="auto")
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
    traces = {t: length_trace(t, args.num_requests or DEFAULT_REQUESTS[t], args.seed,
                              args.max_model_len) for t in args.traces}
    print(f"KV pool {args.pool_tokens} token slots (paged: {args.pool_tokens // args.block_size} "
          f"blocks of {args.block_size}), max_model_len {args.max_model_len}, "
          f"seed {args.seed}")
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
                                         args.block_size)
        all_savings[name] = {n: r.sharing_savings for n, r in runs.items()}
        for n, r in runs.items():
            print(f"{name:<10} {n:>3} {100 * r.sharing_savings:>7.1f}% {r.cow_copies:>11} "
                  f"{r.preemptions:>8}   {PAPER_PARALLEL_SAVINGS.get((name, n), '-')}")
    print("paper (Fig. 15): parallel sampling n = 2..6 saves 6.1%-9.8% on Alpaca, "
          "16.2%-30.5% on ShareGPT")
    if args.beam_widths:
        from pagedserve.engine.llm import LLM

        llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size, seed=args.seed)
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
    from pagedserve.bench.memory_plots import plot_breakdown, plot_sharing  # (imports this module)

    plot_breakdown(all_shares, args.breakdown_plot)
    plot_sharing(all_savings, args.sharing_plot)
    print(f"charts written to {args.breakdown_plot} and {args.sharing_plot}")
    return 0
