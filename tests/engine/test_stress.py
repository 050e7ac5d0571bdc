"""The differential stress harness (tests/engine/stress_harness.py) on a fixed set of seeds:
random workloads under random cache configurations (issue 25's shapes among them: groups running
their sequences in turns, priority scheduling, a prefilling group ahead of a decoding sharing
group) give exactly the outputs of a roomy cache,
finish, keep the block tables consistent and leave both pools empty. A failure names its seeds and
a one-line repro (`python scripts/stress.py --seed N`); `scripts/stress.py --minutes N` runs more.
"""

import pytest
import torch

from pagedserve import SamplingParams
from stress_harness import (
    Harness,
    draft_spec_config_for,
    oracle_spec_config_for,
    spec_config_for,
    Request,
    StressFailure,
    Workload,
    make_engine,
    hybrid_workload,
    make_workload,
    recurrent_workload,
    repro,
    tiny_conv,
    tiny_recurrent,
    tiny_hybrid,
    tiny_llama,
)

NUM_SEEDS = 300
CHUNK = 10


def _one_thread_harness(make_model, folder):
    """A `Harness` on the tiny model `make_model(folder)` writes, torch at one thread while it
    lives: the tiny model's steps are Python-bound, and threads only contend on 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Harness(make_engine(make_model(folder)))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    yield from _one_thread_harness(tiny_llama, tmp_path_factory.mktemp("stress-llama"))


def _run_seeds(harness, first: int, workload_of, count: int = CHUNK, **repro_flags) -> None:
    """`count` seeds from `first` through `harness`; one assertion naming every failed seed with
    its workload and repro command."""
    failures = []
    for seed in range(first, first + count):
        workload = workload_of(seed)
        try:
            harness.run(workload)
        except StressFailure as e:
            failures.append(f"seed {seed} [{e.cause}] {e}\n    {workload.describe()}\n"
                            f"    repro: {repro(seed, **repro_flags)}")
    assert not failures, f"{len(failures)} of {count} seeds failed:\n" + "\n".join(failures)


@pytest.mark.parametrize("first", range(0, NUM_SEEDS, CHUNK),
                         ids=lambda s: f"seeds{s}-{s + CHUNK - 1}")
def test_random_workloads_match_the_roomy_oracle_finish_and_leak_nothing(harness, first):
    _run_seeds(harness, first, make_workload)


HYBRID_SEEDS = 30


@pytest.fixture(scope="module")
def hybrid_harness(tmp_path_factory):
    yield from _one_thread_harness(tiny_hybrid, tmp_path_factory.mktemp("stress-hybrid"))


@pytest.mark.parametrize("first", range(0, HYBRID_SEEDS, CHUNK),
                         ids=lambda s: f"hybrid-seeds{s}-{s + CHUNK - 1}")
def test_random_workloads_on_a_model_mixing_window_and_full_layers(hybrid_harness, first):
    # Issue 36: the same workloads on a model of two layer groups (a sliding-window group giving
    # its blocks back as the window moves, a full one) over one pool: outputs exactly the
    # oracle's, invariants per group, nothing leaked.
    assert hybrid_harness.groups is not None
    _run_seeds(hybrid_harness, first, hybrid_workload, hybrid=True)


# Seeds that `scripts/stress.py --minutes N --hybrid` found failing, kept as regression tests
# (each failed before its fix), with what went wrong.
HYBRID_REGRESSION_SEEDS = {
    51238: "beam search swapped out while one beam was parked by turns and the others held "
           "their candidates: it planned no tokens, so it was never swapped back in (a hang)",
    56249: "the same with a beam width of 3",
}


@pytest.mark.parametrize("seed", sorted(HYBRID_REGRESSION_SEEDS))
def test_seeds_that_once_failed_on_the_hybrid_model_now_pass(hybrid_harness, seed):
    _run_seeds(hybrid_harness, seed, hybrid_workload, count=1, hybrid=True)


CONV_SEEDS = 20


@pytest.fixture(scope="module")
def conv_harness(tmp_path_factory):
    yield from _one_thread_harness(tiny_conv, tmp_path_factory.mktemp("stress-conv"))


@pytest.mark.parametrize("first", range(0, CONV_SEEDS, CHUNK),
                         ids=lambda s: f"conv-seeds{s}-{s + CHUNK - 1}")
def test_random_workloads_on_a_model_with_short_convolution_state(conv_harness, first):
    # LFM2's conv layers keep their state as a window of 3 rows in the cache: the same workloads
    # (preemption, swap, prefix hits, forks, aborts) give the oracle's outputs exactly, and
    # nothing leaks.
    assert conv_harness.groups is not None
    _run_seeds(conv_harness, first, hybrid_workload, conv=True)


RECURRENT_SEEDS = 40


@pytest.fixture(scope="module")
def recurrent_harness(tmp_path_factory):
    yield from _one_thread_harness(tiny_recurrent, tmp_path_factory.mktemp("stress-recurrent"))


@pytest.mark.parametrize("first", range(0, RECURRENT_SEEDS, CHUNK),
                         ids=lambda s: f"recurrent-seeds{s}-{s + CHUNK - 1}")
def test_random_workloads_on_a_model_with_recurrent_state(recurrent_harness, first):
    # Qwen3.5's Gated DeltaNet layer keeps its state in cache entries of each sequence's first
    # logical block: the same workloads (block sizes refitting it, preemption by swap and by
    # recompute, forks copying it, aborts) give the oracle's outputs exactly, nothing leaks.
    assert ("state", len(recurrent_harness.engine.kv_layout.state_columns())) \
        in recurrent_harness.groups
    _run_seeds(recurrent_harness, first, recurrent_workload, recurrent=True)


@pytest.mark.parametrize("first", range(0, 20, CHUNK),
                         ids=lambda s: f"recurrent-oracle-spec-seeds{s}-{s + CHUNK - 1}")
def test_random_workloads_speculating_on_a_recurrent_model_match_the_oracle(recurrent_harness,
                                                                           first):
    # Speculation on the Gated DeltaNet model: drafts from the oracle's own outputs, one row in
    # two spoiled (stress_harness.oracle_proposer), so that rows are accepted in full (the new
    # state kept) and in part (rolled back, core/state_rollback.py); outputs exactly equal.
    spec_harness = Harness(recurrent_harness.engine, spec=oracle_spec_config_for)
    spec_harness.oracle_cache = recurrent_harness.oracle_cache
    try:
        accepted = rollbacks = 0
        for seed in range(first, first + CHUNK):
            workload = recurrent_workload(seed)
            try:
                spec_harness.run(workload)
            except StressFailure as e:
                pytest.fail(f"seed {seed} [{e.cause}] {e}\n    {workload.describe()}\n"
                            f"    repro: {repro(seed, spec='oracle', recurrent=True)}")
            accepted += spec_harness.engine.spec.num_accepted_tokens
            rollbacks += spec_harness.engine.kv_manager.state_rollbacks
    finally:
        recurrent_harness.engine.spec = None
    assert accepted > 0 and rollbacks > 0


SPEC_SEEDS = 40


@pytest.mark.parametrize("first", range(0, SPEC_SEEDS, CHUNK),
                         ids=lambda s: f"spec-seeds{s}-{s + CHUNK - 1}")
def test_random_workloads_with_ngram_speculation_match_the_non_speculative_oracle(harness, first):
    # The same harness, speculating (issue 28): a configuration per seed (stress_harness.
    # SPEC_CONFIGS), the oracle without speculation; outputs exactly equal.
    spec_harness = Harness(harness.engine, spec=spec_config_for)
    spec_harness.oracle_cache = harness.oracle_cache
    failures, accepted = [], 0
    for seed in range(first, first + CHUNK):
        workload = make_workload(seed)
        try:
            spec_harness.run(workload)
            accepted += spec_harness.engine.spec.num_accepted_tokens
        except StressFailure as e:
            failures.append(f"seed {seed} [{e.cause}] {e}\n    {workload.describe()}\n"
                            f"    repro: {repro(seed, spec=True)}")
    harness.engine.spec = None
    assert not failures, f"{len(failures)} of {count} seeds failed:\n" + "\n".join(failures)
    assert accepted > 0  # drafts were proposed and accepted


def test_workloads_are_a_function_of_the_seed():
    a, b = make_workload(123), make_workload(123)
    assert a.config == b.config
    assert [(r.key(), r.arrive, r.abort_at) for r in a.requests] == \
        [(r.key(), r.arrive, r.abort_at) for r in b.requests]


def test_fixed_seeds_cover_every_feature_and_configuration():
    seen = set()
    for seed in range(NUM_SEEDS):
        w = make_workload(seed)
        c = w.config
        seen |= {f"bs{c['block_size']}", f"mode-{c['preemption_mode']}",
                 f"chunked-{c['enable_chunked_prefill']}", f"prefix-{c['enable_prefix_caching']}"}
        if c["max_num_batched_tokens"] <= 4:
            seen.add("budget<=4")
        if c["num_cpu_blocks"] and c["num_cpu_blocks"] <= 2:
            seen.add("small-cpu-pool")
        if any(r.width > c["max_num_seqs"] for r in w.requests):
            seen.add("wider-than-max_num_seqs")
        if c["shuffle_free_blocks_seed"] is not None:
            seen.add("shuffled")
        seen |= {f"shape-{shape}" for shape in w.shapes}
        for r in w.requests:
            p = r.params
            if isinstance(p, SamplingParams):
                seen |= {name for name, on in [
                    ("beam", p.use_beam_search), ("n>1", p.n > 1), ("best_of", r.width > p.n),
                    ("logprobs", p.logprobs is not None), ("stop", bool(p.stop)),
                    ("prompt_logprobs", p.prompt_logprobs is not None),
                    ("stop_token_ids", bool(p.stop_token_ids)), ("min_tokens", p.min_tokens > 0),
                    ("seed", p.seed is not None), ("ignore_eos", p.ignore_eos)] if on}
            else:
                seen.add("add_beam_request")
            if r.abort_at is not None:
                seen.add("abort")
            if r.arrive > 0:
                seen.add("late-arrival")
    want = {f"bs{b}" for b in (1, 2, 3, 4, 8, 16, 32)} | {
        "mode-recompute", "mode-swap", "mode-auto", "chunked-True", "chunked-False",
        "prefix-True", "prefix-False", "budget<=4", "small-cpu-pool", "wider-than-max_num_seqs",
        "shuffled", "beam", "add_beam_request", "n>1", "best_of", "logprobs", "prompt_logprobs",
        "stop", "stop_token_ids", "min_tokens", "seed", "ignore_eos", "abort", "late-arrival",
        "shape-turns", "shape-priority", "shape-prefill-ahead"}
    assert want - seen == set()


def test_harness_reports_a_copy_on_write_that_never_happened(harness, monkeypatch):
    # Three samples forking a prompt whose last block is partly full: each child's first token
    # goes into a copy of that block. Without the copy the child attends over a (NaN-filled)
    # block nobody wrote: the harness must see it.
    engine = harness.engine
    prompt = [1] + list(range(10, 19))  # 10 tokens: the third block of 4 is half full
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True,
                            logprobs=1)
    workload = Workload(0, dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64,
                                enable_chunked_prefill=True, enable_prefix_caching=False,
                                preemption_mode="recompute", num_cpu_blocks=0, max_num_seqs=8,
                                shuffle_free_blocks_seed=None),
                        [Request("cow", prompt, params, 0)])
    harness.run(workload)  # passes as it is
    monkeypatch.setattr(type(engine.kv_cache), "copy_blocks", lambda self, pairs: None)
    with pytest.raises(StressFailure, match="mismatch"):
        harness.run(workload)


def test_harness_reports_a_request_cut_short_by_the_pool(harness, monkeypatch):
    # Issue 25: 4 samples of 24 tokens on a pool that holds one of them alone, not all four.
    # With the old rule (a group alone that cannot grow finishes with "length") the harness
    # must see shorter outputs.
    from pagedserve.core.scheduler import Scheduler

    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    workload = Workload(0, dict(block_size=4, num_kv_blocks=9, max_num_batched_tokens=64,
                                enable_chunked_prefill=True, enable_prefix_caching=False,
                                preemption_mode="recompute", num_cpu_blocks=0, max_num_seqs=8,
                                shuffle_free_blocks_seed=None, scheduling_policy="fcfs"),
                        [Request("cut", [1, 5, 9, 13, 17, 21], params, 0)])
    assert harness.run(workload).turns > 0  # passes as it is
    monkeypatch.setattr(Scheduler, "_turn_victim", lambda self, group, plan: None)
    with pytest.raises(StressFailure, match="tokens, finish_reason 'length'; oracle 24 tokens"):
        harness.run(workload)


DRAFT_SEEDS = 20


def test_random_workloads_with_draft_model_speculation_match_the_non_speculative_oracle(
        tmp_path_factory):
    # A draft-model engine (the tiny model drafting for itself: greedy drafts are accepted, its
    # paged cache moves with the target's), a configuration per seed (stress_harness.
    # draft_spec_config_for); the oracle on the same engine without speculation.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_llama(tmp_path_factory.mktemp("stress-draft"))
        harness = Harness(make_engine(model, draft=model), spec=draft_spec_config_for(model))
        failures, accepted = [], 0
        for seed in range(DRAFT_SEEDS):
            workload = make_workload(seed)
            try:
                harness.run(workload)
                accepted += harness.engine.spec.num_accepted_tokens
            except StressFailure as e:
                failures.append(f"seed {seed} [{e.cause}] {e}\n    {workload.describe()}\n"
                                f"    repro: {repro(seed, spec='draft')}")
    finally:
        torch.set_num_threads(threads)
    assert not failures, f"{len(failures)} of {DRAFT_SEEDS} seeds failed:\n" + "\n".join(failures)
    assert accepted > 0
