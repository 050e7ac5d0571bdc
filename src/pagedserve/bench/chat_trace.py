"""`pagedserve bench chat-trace`: a multi-turn chat trace, and routing across engine cores.

The trace (`chat_trace`): `conversations` conversations, each opening with one of
`system_prompts` shared system prompts, then `turns` turns; a turn sends the whole history
(system prompt, every earlier user message and reply) plus a new user message, and the reply
(`reply_tokens` greedy tokens) joins the history of the next turn. Seeded token ids: no
tokenizer, no text, the same trace for every engine.

`run_chat_trace(engine, trace, concurrency)` drives it closed-loop through the engine's own
calls (`add_request` / `step`, the same on an `LLMEngine` and on the data-parallel front end):
`concurrency` conversations are in flight, each sends its next turn when its reply is complete.
It reports the prefix-cache hit rate (prompt tokens found cached / looked up, summed over the
cores: it depends on where each turn went, not on timing), TTFT p50 and mean, output tokens/s.
NOTE: with two cores round-robin's TTFTs are bimodal (a turn that lands on the core of the
conversation's previous turn finds all of its history), so its p50 sits between the two modes;
the mean weighs the turns that rebuild a history.

`main` compares, on one trace: a single engine; data parallelism with prefix routing, least-load
and round-robin; DP=2 with one thread per core against DP=1 with two threads; and, with
`--kill-core`, a core killed mid-run (every request completes or fails naming the engine).
`--kv-cache-memory B` sizes each core of the DP=2 runs; the DP=1 runs then get 2B, so every run
holds the same total KV memory. A budget the trace's live histories outgrow on one core but not
on half of them is where routing by cache matters most: round-robin sends every conversation to
both cores, so each core must hold all of them, while prefix routing keeps each on one.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass


@dataclass
class ChatTrace:
    """System prompts, and per conversation its system prompt and its turns' user messages."""

    system_prompts: list[list[int]]
    conversations: list[tuple[int, list[list[int]]]]
    reply_tokens: int

    @property
    def num_requests(self) -> int:
        return sum(len(turns) for _, turns in self.conversations)


def chat_trace(conversations: int = 32, turns: int = 4, system_prompts: int = 4,
               system_len: int = 64, user_len: tuple[int, int] = (8, 32),
               reply_tokens: int = 16, vocab: tuple[int, int] = (3, 500),
               seed: int = 0) -> ChatTrace:
    """A seeded multi-turn chat trace (see the module docstring)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*vocab) for _ in range(n)]

    systems = [[1] + tokens(system_len - 1) for _ in range(system_prompts)]
    convs = [(rng.randrange(system_prompts), [tokens(rng.randint(*user_len)) for _ in range(turns)])
             for _ in range(conversations)]
    return ChatTrace(systems, convs, reply_tokens)


@dataclass
class TraceResult:
    completed: int
    failed: list[tuple[str, str]]
    hit_rate: float
    ttft: list[float]
    output_tokens: int
    seconds: float

    @property
    def ttft_p50(self) -> float:
        return statistics.median(self.ttft) if self.ttft else float("nan")

    @property
    def ttft_mean(self) -> float:
        return statistics.fmean(self.ttft) if self.ttft else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def hit_rate_of(engine) -> tuple[int, int]:
    """(prefix-cache hits, queries) in tokens so far: an `LLMEngine`'s, or summed over a front
    end's cores."""
    totals = getattr(engine, "core_totals", None)
    if totals is not None:
        stats = totals().values()
        return sum(s.prefix_hits for s in stats), sum(s.prefix_queries for s in stats)
    kv = engine.kv_manager
    return kv.prefix_hits, kv.prefix_queries


def run_chat_trace(engine, trace: ChatTrace, concurrency: int = 8,
                   on_step=None, seed: int = 0) -> TraceResult:
    """Drive `trace` through `engine` closed-loop (see the module docstring). A conversation
    whose reply is complete rejoins the queue of those waiting to send at a seeded random place
    (users take their time to answer), so arrivals do not fall into a fixed period. `on_step(step
    number)` runs after every step (the kill drill uses it)."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=trace.reply_tokens, ignore_eos=True)
    rng = random.Random(seed)
    hits0, queries0 = hit_rate_of(engine)
    history = [list(trace.system_prompts[s]) for s, _ in trace.conversations]
    next_turn = [0] * len(trace.conversations)
    queue = list(range(len(trace.conversations)))
    running: dict[str, tuple[int, float, bool]] = {}  # request id -> (conv, sent at, got token)
    ttft: list[float] = []
    failed: list[tuple[str, str]] = []
    completed = output_tokens = steps = 0
    start = time.monotonic()

    def send(conv: int) -> None:
        turn = next_turn[conv]
        history[conv] += trace.conversations[conv][1][turn]
        request_id = f"c{conv}t{turn}"
        engine.add_request(request_id, None, params, prompt_token_ids=list(history[conv]))
        running[request_id] = (conv, time.monotonic(), False)

    while queue and len(running) < concurrency:
        send(queue.pop(0))
    while running:
        try:
            outs = engine.step()
        except Exception as exc:  # noqa: BLE001 - a request lost with its core: recorded
            request_id = next((r for r in running if r in str(exc)), None)
            lost = [r for r in running if not engine_knows(engine, r)]
            for r in lost or ([request_id] if request_id else []):
                conv, _, _ = running.pop(r)
                failed.append((r, str(exc)))
                next_turn[conv] = len(trace.conversations[conv][1])  # the conversation ends
            while queue and len(running) < concurrency:
                send(queue.pop(0))
            continue
        steps += 1
        now = time.monotonic()
        for out in outs:
            entry = running.get(out.request_id)
            if entry is None:
                continue
            conv, sent, seen = entry
            if not seen and out.outputs and out.outputs[0].token_ids:
                ttft.append(now - sent)
                running[out.request_id] = (conv, sent, True)
            if out.finished:
                del running[out.request_id]
                completed += 1
                reply = out.outputs[0].token_ids
                output_tokens += len(reply)
                history[conv] += reply
                next_turn[conv] += 1
                if next_turn[conv] < len(trace.conversations[conv][1]):
                    queue.insert(rng.randint(0, len(queue)), conv)
        while queue and len(running) < concurrency:
            send(queue.pop(0))
        if on_step is not None:
            on_step(steps)
    hits, queries = hit_rate_of(engine)
    hits, queries = hits - hits0, queries - queries0
    return TraceResult(completed, failed, hits / queries if queries else 0.0, ttft,
                       output_tokens, time.monotonic() - start)


def engine_knows(engine, request_id: str) -> bool:
    """Whether the engine still has the request in flight."""
    in_flight = getattr(engine, "in_flight", None)
    if in_flight is not None:
        return request_id in in_flight
    return request_id in engine.groups


# --- the benchmark -----------------------------------------------------------------------------


def add_bench_chat_trace_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--user-len", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"),
                        help="a user message's length in tokens, drawn uniformly in [MIN, MAX]")
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--trace-seed", type=int, default=0)
    parser.add_argument("--kill-core", action="store_true",
                        help="also kill engine core 1 mid-run (DP=2, prefix routing)")
    parser.add_argument("--only", default=None,
                        help="comma-separated subset of: single,prefix,least-load,round-robin,"
                             "dp1x2,dp2x1")


def _engine(args, **changes):
    import dataclasses

    from pagedserve.config import EngineArgs
    from pagedserve.engine.llm import make_engine

    fields = set(EngineArgs.field_names())
    base = EngineArgs(**{k: v for k, v in vars(args).items() if k in fields})
    return make_engine(dataclasses.replace(base, **changes))


def _row(name: str, result: TraceResult) -> str:
    return (f"| {name} | {result.hit_rate:.3f} | {result.ttft_p50 * 1000:.0f} | "
            f"{result.ttft_mean * 1000:.0f} | "
            f"{result.tokens_per_s:.1f} | {result.completed} | {len(result.failed)} |")


def main(args: argparse.Namespace) -> int:
    if not 1 <= args.user_len[0] <= args.user_len[1]:
        raise ValueError(f"--user-len must be 1 <= MIN <= MAX, got {args.user_len}")
    trace = chat_trace(args.conversations, args.turns, args.system_prompts, args.system_len,
                       user_len=tuple(args.user_len), reply_tokens=args.reply_tokens,
                       seed=args.trace_seed)
    only = set(args.only.split(",")) if args.only else None
    runs = [("single", dict(data_parallel_size=1)),
            ("prefix", dict(data_parallel_size=2, data_parallel_routing="prefix")),
            ("least-load", dict(data_parallel_size=2, data_parallel_routing="least-load")),
            ("round-robin", dict(data_parallel_size=2, data_parallel_routing="round-robin")),
            ("dp1x2", dict(data_parallel_size=1, cpu_threads=2, engine_core_process=True)),
            ("dp2x1", dict(data_parallel_size=2, data_parallel_routing="prefix"))]
    print(f"trace: {args.conversations} conversations x {args.turns} turns, "
          f"{trace.num_requests} requests, concurrency {args.concurrency}")
    print("| run | prefix-cache hit rate | TTFT p50 (ms) | TTFT mean (ms) | output tok/s | "
          "completed | failed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    budget = getattr(args, "kv_cache_memory", None)
    if budget:
        print(f"KV cache: {budget} bytes per core of the DP=2 runs; the DP=1 runs get "
              f"{2 * budget} (the same total)")
    notes: list[str] = []
    for name, changes in runs:
        if only is not None and name not in only:
            continue
        if budget and changes["data_parallel_size"] == 1:
            # NOTE: one engine against two compares equal memory: a fixed budget is per core
            changes = dict(changes, kv_cache_memory=2 * budget)
        engine = _engine(args, **changes)
        try:
            run_chat_trace(engine, chat_trace(2, 1, 1, 16, reply_tokens=2, seed=99), 2)  # warm
            router = getattr(engine, "router", None)
            before = (router.prefix_routed, router.overloaded) if router else None
            print(_row(name, run_chat_trace(engine, trace, args.concurrency)), flush=True)
            if router is not None and router.policy == "prefix":
                # where prefix routing gave way to load (each such turn rebuilds its history
                # on the other core): the first thing to look at when its hit rate falls short
                notes.append(f"{name}: {router.prefix_routed - before[0]} turns sent to the "
                             f"core holding their longest prefix, {router.overloaded - before[1]}"
                             f" to the least loaded instead (threshold {router.threshold} tokens)")
        finally:
            getattr(engine, "shutdown", lambda: None)()
    for note in notes:
        print(note)
    if args.kill_core:
        engine = _engine(args, data_parallel_size=2, data_parallel_routing="prefix")
        try:
            total = trace.num_requests

            def kill(step: int) -> None:
                if step == 20:
                    engine.client.kill(1)

            result = run_chat_trace(engine, trace, args.concurrency, on_step=kill)
            print(_row("killed core 1 at step 20", result))
            print(f"requests: {total} in the trace; {result.completed} completed, "
                  f"{len(result.failed)} failed naming the engine: "
                  f"{all('engine core 1' in m for _, m in result.failed)}; none hung")
        finally:
            engine.shutdown()
    return 0
