"""The scheduler and block manager alone on random workloads, thousands a second (no model: a fake
runner draws tokens, beam candidates and accepted drafts): every admitted request finishes with
all its tokens (or at the stop it was owed: EOS, a stop token id, past min_tokens) and the
prompt logprobs it asked for (chunks in order), the queues and tables stay consistent after every step, and both pools end empty. The model-based
harness (tests/engine/stress_harness.py) also checks outputs exactly; this one covers far more
schedules per second, so it finds hangs and leaks sooner. What it found is kept below as
regression seeds (each failed before its fix; the seeds name workloads of this generator as it
is: change the generator and find them again). A failure names its seed and workload;
`run_workload(N)` replays one, and `python tests/core/test_scheduler_fuzz.py FIRST LAST` runs a
range.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from pagedserve.core import step_update
from pagedserve.core.beam_search import BeamSearchParams, BeamState
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_spec import (
    FullAttentionSpec,
    KVLayout,
    RecurrentStateSpec,
    SlidingWindowSpec,
)
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.spec_decode import SpecDecoder, SpeculativeConfig
from pagedserve.core.step_output import SampleResult, SeqStepOutput
from pagedserve.lora.engine import cache_key
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus

MAX_MODEL_LEN = 64
# A hang: no token appended anywhere for STALL_STEPS steps while requests are unfinished (the
# longest wait for progress: a beam's turn recomputing ~64 tokens at a budget of 4 a step, for
# each of its siblings); MAX_STEPS bounds the whole run. NOTE: a beam search whose beams cannot
# all be resident takes turns, recomputing parked beams: O(length^2) steps at small budgets
# (seed 3005763: 3,154 steps), slow but finite.
STALL_STEPS = 1000
MAX_STEPS = 30000


def _layout(rng: random.Random) -> KVLayout | None:
    """None (one group), or sliding-window layers beside full ones (issue 36's groups)."""
    if rng.random() < 0.5:
        return None
    window = rng.choice([2, 4, 8, 16])
    sliding, full = rng.randint(1, 3), rng.randint(1, 2)
    return KVLayout.from_specs([SlidingWindowSpec(1, 32, window=window)] * sliding
                               + [FullAttentionSpec(1, 32)] * full)


class Workload:
    """A seeded cache, scheduler configuration and request list."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self.seed = seed
        chunked = rng.random() < 0.8
        budget = rng.choice([4, 8, 16, 64]) if chunked else 64
        self.config = SchedulerConfig(
            max_num_seqs=rng.randint(2, 8), max_num_batched_tokens=budget,
            max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=chunked,
            preemption_mode=rng.choice(["swap", "recompute", "auto"]),
            swap_seconds_per_block=rng.choice([0.0, 1.0]),
            recompute_seconds_per_token=rng.choice([0.0, 1.0]),
            scheduling_policy=rng.choice(["fcfs", "priority"]),
            long_prefill_token_threshold=rng.choice([0, 0, 3]) if chunked else 0,
            prompt_budget_per_decode_row=rng.choice([0, 1, 32]) if chunked else 0,
            max_loras=rng.choice([0, 0, 1, 2]))
        self.block_size = rng.choice([1, 2, 4, 8])
        self.num_blocks = rng.randint(4, 48)
        self.num_cpu_blocks = rng.choice([0, 2, 8, 64])
        self.prefix_caching = rng.random() < 0.4
        self.layout = _layout(rng)
        if self.layout is None and random.Random(seed * 7919 + 3).random() < 0.5:
            # a recurrent state beside attention (Gated DeltaNet / Mamba: a block per sequence
            # in its first logical block; prefix hits start from state snapshots). Drawn apart,
            # so that the other layouts' workloads stay as they were.
            self.layout = KVLayout.from_specs([FullAttentionSpec(1, 32)] * 2
                                              + [RecurrentStateSpec(1, 32)] * 3)
        self.shuffle = rng.choice([None, seed])
        stems = [[rng.randrange(1000) for _ in range(rng.randint(1, 20))] for _ in range(3)]
        self.requests = []
        for i in range(rng.randint(1, 8)):
            kind = rng.choice(["greedy", "sample", "beam"])
            width = 1 if kind == "greedy" else rng.randint(2, 4)
            prompt = list(rng.choice(stems))[: rng.randint(1, 20)] + \
                [rng.randrange(1000) for _ in range(rng.randint(0, 8))]
            self.requests.append(dict(
                rid=f"r{i}", kind=kind, width=width, prompt=prompt or [1],
                max_tokens=rng.randint(1, 16), arrive=rng.randint(0, 12),
                abort_at=rng.randint(1, 40) if rng.random() < 0.2 else None,
                priority=rng.randint(-2, 2) if self.config.scheduling_policy == "priority" else 0,
                lora=rng.choice([0, 1, 2, 3]) if self.config.max_loras else 0))
        # early stops: EOS (token 0) unless ignore_eos, stop_token_ids, min_tokens. Drawn apart
        # (another stream), so that the workloads of the other draws stay as they were.
        stops = random.Random(seed * 7919 + 8)
        self.eos = stops.random() < 0.3
        for r in self.requests:
            r["ignore_eos"] = not (self.eos and stops.random() < 0.7)
            r["stop"] = [stops.randrange(1, VOCAB)] if self.eos and stops.random() < 0.3 else []
            r["min_tokens"] = stops.randint(0, r["max_tokens"]) if self.eos else 0
        if self.eos:
            self.config = dataclasses.replace(self.config, eos_token_ids=(0,))
        # outputs that reach max_model_len (FINISHED_LENGTH at the cap): drawn apart as well
        if random.Random(seed * 7919 + 12).random() < 0.2:
            for r in self.requests:
                r["max_tokens"] = MAX_MODEL_LEN
        # prompt logprobs (the whole prompt computed, no prefix hit; chunks in order): drawn
        # apart as the stops are
        plp = random.Random(seed * 7919 + 9)
        self.prompt_logprobs = plp.random() < 0.3
        for r in self.requests:
            r["prompt_logprobs"] = 1 if (self.prompt_logprobs and r["kind"] != "beam"
                                         and plp.random() < 0.5) else None
        # n-gram speculation (k drafts a row; the fake runner accepts a random prefix of them):
        # no beam search beside it, as the engine refuses
        self.spec_k = rng.choice([0, 0, 1, 3])
        if self.spec_k:
            for r in self.requests:
                if r["kind"] == "beam":
                    r["kind"] = "sample"

    def _layout_name(self) -> str:
        if self.layout is None:
            return "one"
        return "+".join(g.name for g in self.layout.groups)

    def describe(self) -> str:
        c = self.config
        return (f"seed {self.seed}: bs={self.block_size} blocks={self.num_blocks} "
                f"cpu={self.num_cpu_blocks} budget={c.max_num_batched_tokens} "
                f"chunked={c.enable_chunked_prefill} mode={c.preemption_mode} "
                f"seqs={c.max_num_seqs} {c.scheduling_policy} prefix={self.prefix_caching} "
                f"max_loras={c.max_loras} spec_k={self.spec_k} eos={self.eos} "
                f"prompt_logprobs={self.prompt_logprobs} "
                f"groups={self._layout_name()} reqs="
                + " ".join(f"{r['kind']}{r['width']}:{len(r['prompt'])}+{r['max_tokens']}"
                           f"@{r['arrive']}" + (f"/lora{r['lora']}" if r["lora"] else "")
                           for r in self.requests))


_ids = iter(range(10**9))


def _group(req: dict) -> SequenceGroup:
    """The request as the engine queues it (a beam search or n > 1 forks after its prompt)."""
    kind, width = req["kind"], req["width"]
    stops = dict(ignore_eos=req.get("ignore_eos", True), min_tokens=req.get("min_tokens", 0))
    if req.get("prompt_logprobs") is not None:
        stops["prompt_logprobs"] = req["prompt_logprobs"]
    if kind == "beam":
        params = SamplingParams(n=width, max_tokens=req["max_tokens"], temperature=0.0,
                                use_beam_search=True, **stops)
    elif kind == "sample":
        params = SamplingParams(n=width, max_tokens=req["max_tokens"], temperature=1.0, seed=1,
                                stop_token_ids=req.get("stop") or None, **stops)
    else:
        params = SamplingParams(max_tokens=req["max_tokens"], temperature=0.0,
                                stop_token_ids=req.get("stop") or None, **stops)
    count = 1 if kind == "beam" else width
    lora = LoRARequest(f"a{req['lora']}", req["lora"], f"/adapters/a{req['lora']}") \
        if req["lora"] else None
    g = SequenceGroup(req["rid"], [Sequence(next(_ids), list(req["prompt"]), i)
                                   for i in range(count)], params, float(req["arrive"]),
                      priority=req["priority"], lora_request=lora)
    for seq in g.seqs:  # (as the engine salts them: two adapters never share KV blocks)
        seq.cache_salt = cache_key(None, lora)
    if kind == "beam":
        g.beam = BeamState(BeamSearchParams(beam_width=width, max_tokens=req["max_tokens"],
                                            ignore_eos=stops["ignore_eos"]))
    g.fork_pending = count > 1
    if params.prompt_logprobs is not None:  # (as the engine queues it: the first position's)
        g.prompt_logprobs = [None]
    return g


VOCAB = 16  # small, so that n-grams recur and the n-gram proposer drafts


def _results(out, rng: random.Random) -> list[SeqStepOutput]:
    """A fake runner: a token (or a beam's 2 x width candidates) for every row at its end; a
    speculative row accepts a random prefix of its drafts, then a token."""
    results = []
    for s in out.scheduled:
        if s.wants_prompt_logprobs:  # (no draws: the other workloads' streams stay the same)
            results.append(SeqStepOutput(s.seq.seq_id, [], [(-1.0, 1, [])] * s.num_tokens))
            if s.do_sample:  # (the prompt's last chunk also samples)
                results[-1].samples.extend([SampleResult(rng.randrange(VOCAB), -1.0, 1, None)]
                                           * s.num_samples)
        elif not s.do_sample:
            results.append(SeqStepOutput(s.seq.seq_id, []))
        elif s.spec_token_ids:
            accepted = rng.randint(0, len(s.spec_token_ids))
            results.append(SeqStepOutput(s.seq.seq_id, [
                SampleResult(t, -1.0, 1, None)
                for t in list(s.spec_token_ids[:accepted]) + [rng.randrange(VOCAB)]]))
        elif s.group.beam is not None:
            width = s.group.beam.params.beam_width
            tokens = rng.sample(range(VOCAB), 2 * width)
            results.append(SeqStepOutput(s.seq.seq_id, [], None, beam_candidates=sorted(
                ((t, -rng.random() * 5) for t in tokens), key=lambda c: -c[1])))
        else:
            results.append(SeqStepOutput(s.seq.seq_id, [
                SampleResult(rng.randrange(VOCAB), -1.0, 1, None)] * s.num_samples))
    return results


class FuzzFailure(AssertionError):
    pass


def _stopped_at(params: SamplingParams, out_ids: list[int], eos_ids) -> int | None:
    """The output length at which a stop token ends the sequence (EOS unless ignore_eos, a
    stop token id; not before min_tokens), or None."""
    stops = set(params.stop_token_ids or ())
    if not params.ignore_eos:
        stops |= set(eos_ids)
    for n, tok in enumerate(out_ids, 1):
        if n >= params.min_tokens and tok in stops:
            return n
    return None


def run_workload(seed: int, max_steps: int = MAX_STEPS) -> None:
    """Drive one seeded workload to its end; raise FuzzFailure naming the seed on any fault."""
    w = Workload(seed)
    rng = random.Random(seed + 1)
    kv = KVCacheManager(w.num_blocks, w.block_size, shuffle_seed=w.shuffle,
                        num_cpu_blocks=w.num_cpu_blocks, enable_prefix_caching=w.prefix_caching,
                        layout=w.layout)
    sched = Scheduler(w.config, kv)
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=w.spec_k, prompt_lookup_max=3)) \
        if w.spec_k else None
    groups: dict[str, SequenceGroup] = {}
    aborted: set[str] = set()
    pending = sorted(w.requests, key=lambda r: r["arrive"])
    covered: dict[str, int] = {}  # prompt positions whose logprobs came, per request
    step = last_progress = last_appended = 0
    try:
        while pending or sched.has_unfinished():
            while pending and pending[0]["arrive"] <= step:
                req = pending.pop(0)
                final = min(MAX_MODEL_LEN, len(req["prompt"]) + req["max_tokens"])
                # the engine's admission rule: one sequence alone fits the pool
                if (req["width"] > w.config.max_num_seqs or kv.blocks_for(
                        final - 1, w.config.max_num_batched_tokens) > w.num_blocks):
                    continue
                groups[req["rid"]] = g = _group(req)
                sched.add(g)
            for req in w.requests:
                if req["abort_at"] == step and req["rid"] in groups and sched.abort(req["rid"]):
                    aborted.add(req["rid"])
            if spec is not None:  # as the engine does before each schedule
                spec.propose(sched.running, MAX_MODEL_LEN)
            out = sched.schedule()
            for s in out.scheduled:  # prompt logprobs: chunks in order (from 0 after a recompute)
                if s.wants_prompt_logprobs:
                    rid = s.group.request_id
                    if s.start not in (0, covered.get(rid, 0)):
                        raise FuzzFailure(f"{rid}: prompt logprobs from {s.start}, "
                                          f"{covered.get(rid, 0)} covered")
                    covered[rid] = s.end
            sched.update_from_output(out, _results(out, rng))
            sched.check_invariants()
            step += 1
            appended = sum(len(q.token_ids) for g in groups.values() for q in g.seqs)
            if appended != last_appended:
                last_appended, last_progress = appended, step
            if step - last_progress > STALL_STEPS:
                raise FuzzFailure(f"no token appended in {STALL_STEPS} steps (a hang)")
            if step > max_steps:
                raise FuzzFailure(f"not finished after {max_steps} steps (a hang)")
        for rid, g in groups.items():
            if rid in aborted:
                continue
            want = g.sampling_params.max_tokens
            if g.sampling_params.prompt_logprobs is not None and (
                    not g.prompt_logprobs_done
                    or covered.get(rid, 0) < g.seqs[0].num_prompt_tokens):
                raise FuzzFailure(f"{rid}: prompt logprobs of {covered.get(rid, 0)} positions "
                                  f"of {g.seqs[0].num_prompt_tokens}")
            if g.beam is not None:
                if len(g.extra.get("beam_final", [])) != g.beam.params.beam_width:
                    raise FuzzFailure(f"{rid}: beam search ended without its hypotheses")
                continue
            cap = min(want, MAX_MODEL_LEN - len(g.seqs[0].prompt_token_ids))
            for q in g.seqs:  # whole, or ended by a stop it was owed (at or past min_tokens)
                out_ids = q.token_ids[q.num_prompt_tokens:]
                stopped = _stopped_at(g.sampling_params, out_ids, w.config.eos_token_ids)
                if q.status is SequenceStatus.FINISHED_STOPPED and stopped == len(out_ids):
                    continue
                if q.status is not SequenceStatus.FINISHED_LENGTH or len(out_ids) != cap \
                        or stopped is not None:
                    raise FuzzFailure(f"{rid}: seq {q.seq_id} {q.status.name} with "
                                      f"{len(out_ids)} tokens {out_ids} (max {cap}, first "
                                      f"stop owed after {stopped})")
        if kv.num_free_blocks != w.num_blocks:
            raise FuzzFailure(f"{w.num_blocks - kv.num_free_blocks} device blocks leaked")
        if w.num_cpu_blocks and kv.num_free_cpu_blocks != w.num_cpu_blocks:
            raise FuzzFailure(f"{w.num_cpu_blocks - kv.num_free_cpu_blocks} CPU blocks leaked")
    except FuzzFailure as e:
        raise FuzzFailure(f"{w.describe()}\n  step {step}: {e}") from None
    except Exception as e:  # an invariant or the scheduler itself
        raise FuzzFailure(f"{w.describe()}\n  step {step}: {type(e).__name__}: {e}") from e


SEEDS = 2000
CHUNK = 250
REGRESSION_SEEDS = {
    38926: "beams swapped out while one was parked by turns and the others held their "
           "candidates planned no tokens and were never swapped back in (a hang)",
    1844: "a state model's beam alone in the cache, started from a prefix-cache snapshot in "
          "the step, could not grow while the snapshot stayed pinned: it was cut short "
          "(finish_reason length) instead of computing a shorter chunk",
    1322452: "a state model's request whose prefix hit (a snapshot) cost more blocks than the "
             "empty pool held waited for them for good (a hang) instead of starting without it",
}


@pytest.mark.parametrize("seed", sorted(REGRESSION_SEEDS))
def test_seeds_that_once_failed_now_pass(seed):
    try:
        run_workload(seed)
    except FuzzFailure as e:
        pytest.fail(f"{REGRESSION_SEEDS[seed]}\n{e}")


@pytest.mark.parametrize("first", range(0, SEEDS, CHUNK), ids=lambda s: f"seeds{s}")
def test_random_workloads_finish_whole_and_leave_both_pools_empty(first):
    failures = []
    for seed in range(first, first + CHUNK):
        try:
            run_workload(seed)
        except FuzzFailure as e:
            failures.append(str(e))
    assert not failures, f"{len(failures)} of {CHUNK} seeds failed:\n" + "\n".join(failures[:5])


@pytest.mark.parametrize("mutation", ["beams never advance", "freed blocks kept",
                                      "stop tokens ignored"])
def test_the_fuzzer_fails_on_a_broken_scheduler(monkeypatch, mutation):
    # The checks can fail: a beam step that never runs hangs every beam search, a free that
    # keeps its blocks leaks them, and sequences that run past their EOS are caught.
    if mutation == "beams never advance":
        monkeypatch.setattr(step_update, "_beam_step", lambda scheduler, group: 0)
    elif mutation == "freed blocks kept":
        monkeypatch.setattr(KVCacheManager, "free", lambda self, seq_id: None)
    else:
        append = step_update._append_token
        monkeypatch.setattr(step_update, "_append_token",
                            lambda sched, g, seq, sample, obs, eos, max_len:
                            append(sched, g, seq, sample, obs, (), max_len))
    failed = 0
    for seed in range(80):
        try:
            run_workload(seed, max_steps=300)
        except FuzzFailure:
            failed += 1
    assert failed >= 8


if __name__ == "__main__":  # a range of seeds: python tests/core/test_scheduler_fuzz.py 0 100000
    import sys

    first, last = int(sys.argv[1]), int(sys.argv[2])
    failed = 0
    for n in range(first, last):
        try:
            run_workload(n)
        except FuzzFailure as e:
            failed += 1
            print(e, flush=True)
        if (n + 1 - first) % 50_000 == 0:  # (progress, for runs cut short by a time limit)
            print(f"up to seed {n}: {n + 1 - first} run, {failed} failed", flush=True)
    print(f"{failed} of {last - first} seeds failed")
    sys.exit(1 if failed else 0)
