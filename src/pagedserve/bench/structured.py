"""`pagedserve bench throughput --structured json`: the per-step cost of structured outputs.

The same trace runs unconstrained and with every request constrained to a JSON schema, the two
alternating (`rounds` times each) in one process so that a noisy machine weighs on both alike.
Only full decode steps count (every row one token, `max_num_seqs` rows), so both sides compare
the same batch: more requests than rows keep the batch full as constrained requests end early.
"""

from __future__ import annotations

import statistics
import time

# A record a model writes readily: strings, numbers, an enum and a list.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "role", "tags", "score"],
}


def full_decode_step_times(engine, prompts, params, rows: int) -> list[float]:
    """Run `prompts` to the end step by step; the seconds of each step that decoded exactly
    `rows` sequences (one token each)."""
    scheduled = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        scheduled.append(out)
        return out

    engine.scheduler.schedule = recording_schedule  # NOTE: restored below
    times = []
    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"bench-{time.monotonic_ns()}-{i}", None, sp, prompt_token_ids=p)
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            took = time.perf_counter() - start
            sched = scheduled.pop()
            if len(sched.scheduled) == rows and all(s.num_tokens == 1 for s in sched.scheduled):
                times.append(took)
    finally:
        engine.scheduler.schedule = schedule
    return times


def compare(engine, trace, rows: int, temperature: float, seed: int, rounds: int = 3) -> str:
    """The report of unconstrained vs JSON-schema steps (see the module docstring)."""
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.structured_output import StructuredOutputsParams

    so = StructuredOutputsParams(json=BENCH_SCHEMA)
    prompts = [r.prompt_token_ids for r in trace]

    def params(constrained: bool):
        return [SamplingParams(temperature=temperature, seed=seed + i if temperature else None,
                               max_tokens=r.output_len, ignore_eos=not constrained,
                               structured_outputs=so if constrained else None)
                for i, r in enumerate(trace)]

    samples = {False: [], True: []}
    tokens = {False: 0, True: 0}
    for _ in range(rounds):
        for constrained in (False, True):
            before = engine.stats["generation_tokens"]
            samples[constrained] += full_decode_step_times(engine, prompts, params(constrained),
                                                           rows)
            tokens[constrained] += engine.stats["generation_tokens"] - before
    lines = []
    for constrained, name in ((False, "unconstrained"), (True, "json schema")):
        t = samples[constrained]
        if not t:
            return f"no full decode steps of {rows} rows: raise --num-prompts or output lengths"
        lines.append(f"{name:>14}: {statistics.median(t) * 1e3:8.2f} ms/step median, "
                     f"{statistics.fmean(t) * 1e3:8.2f} mean over {len(t)} full decode steps "
                     f"of {rows} rows ({tokens[constrained]} tokens)")
    ratio = statistics.median(samples[True]) / statistics.median(samples[False])
    lines.append(f"structured json costs {100 * (ratio - 1):+.1f}% per step (median; target "
                 f"<= +15%)")
    return "\n".join(lines)
