"""A model mixing sliding-window and full-attention layers on the pool of layer groups (issue
36): the tiny Gemma 3 (three layers of window 6, one full; a pool block holds one layer) with
prompts several windows long. Everything that moves KV around -- chunked prefill, prefix caching,
preemption by recomputation and by swapping, copy-on-write of n > 1 and beam search -- gives
tokens and logprobs exactly equal to a roomy run (float32), while the sliding-window group holds
only its window; an abort storm leaves every group's blocks back in the pool."""

from __future__ import annotations

import random

import pytest

from pagedserve import BeamSearchParams, SamplingParams
from test_llm_engine import prompts_of_lengths
from utils import assert_same_outputs, drive, run_requests

WINDOW, BS = 6, 4
SHARED = prompts_of_lengths([14], seed=21)[0]


def _requests():
    """Greedy, seeded n > 1 (copy-on-write of the shared prompt), best_of and beam search;
    prompts of 3 to 7 windows, some sharing a prefix (prefix caching)."""
    long = prompts_of_lengths([38, 27, 21, 33], seed=22)
    prompts = [SHARED + p[1:] for p in prompts_of_lengths([9, 16], seed=23)] + long
    lp = dict(logprobs=2, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, max_tokens=10, prompt_logprobs=1, **lp),
              SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=9, **lp),
              SamplingParams(temperature=0.0, max_tokens=12, **lp),
              SamplingParams(n=2, best_of=3, temperature=0.9, seed=7, max_tokens=8, **lp),
              BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, max_tokens=10, **lp)]
    return [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))]


@pytest.fixture(scope="module")
def setup(checkpoints):
    path = str(checkpoints("gemma3"))
    # (no CPU swap pool where nothing is preempted: 4 GiB of one-layer blocks is 4M of them)
    ref, engine = run_requests(path, _requests(), block_size=BS, kv_cache_memory=1 << 24,
                               enable_chunked_prefill=False, enable_prefix_caching=False,
                               preemption_mode="recompute")
    layout = engine.kv_layout
    assert layout.width == 4 and [g.window for g in layout.groups] == [WINDOW, None]
    return path, ref


@pytest.mark.parametrize("name,options", [
    ("chunked+prefix", dict(max_num_batched_tokens=11, enable_prefix_caching=True,
                            kv_cache_memory=1 << 24, preemption_mode="recompute")),
    ("recompute", dict(num_kv_blocks=90, preemption_mode="recompute", max_num_batched_tokens=16,
                       enable_prefix_caching=True)),
    ("swap", dict(num_kv_blocks=90, num_cpu_blocks=400, preemption_mode="swap",
                  max_num_batched_tokens=16)),
])
def test_mixed_window_model_is_exact_under_every_way_kv_moves(setup, name, options):
    path, ref = setup
    requests = _requests()
    outs, engine = run_requests(path, requests, block_size=BS, **options)
    assert_same_outputs(outs, ref)
    sched, kv = engine.scheduler, engine.kv_manager
    if name == "chunked+prefix":
        assert kv.prefix_hits > 0  # the second shared prompt started from cached blocks
    else:
        assert sched.preemptions_by_mode[name] > 0
    assert kv.pool.num_used == 0 and all(n == 0 for _, n in kv.group_usage())
    if name == "chunked+prefix":  # run again: every prompt hits the cache, same outputs
        before = kv.prefix_hits
        requests = requests[:3]
        for rid, prompt, params in requests:
            add = engine.add_beam_request if isinstance(params, BeamSearchParams) \
                else engine.add_request
            add(rid + "-again", None, params, prompt_token_ids=prompt)
        final = drive(engine, 5000)
        assert_same_outputs([final[rid + "-again"] for rid, _, _ in requests], ref[:3])
        # every prompt found most of its blocks (a sliding group needs only its window's)
        assert kv.prefix_hits - before >= sum(len(p) for _, p, _ in requests) // 2


def test_a_long_prompt_holds_its_window_and_a_chunk_in_the_sliding_group(setup):
    path, _ = setup
    from pagedserve import LLM

    chunk = 8
    llm = LLM(path, dtype="float32", block_size=BS, kv_cache_memory=1 << 24,
              max_num_batched_tokens=chunk, enable_prefix_caching=False,
              preemption_mode="recompute")
    engine = llm.engine
    engine.add_request("long", None, SamplingParams(max_tokens=6, ignore_eos=True),
                       prompt_token_ids=prompts_of_lengths([44], seed=9)[0])
    sliding_peak = full_peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        usage = dict(engine.kv_manager.group_usage())
        sliding_peak = max(sliding_peak, usage[f"sliding-{WINDOW}"])
        full_peak = max(full_peak, usage["full"])
        engine.check_invariants()
        groups = engine.last_schedule_info()["kv_groups"]  # the live metrics' figures
        assert [g[0] for g in groups] == [f"sliding-{WINDOW}", "full"]
        total = engine.kv_manager.num_blocks
        assert [round(g[1] * total) for g in groups] == [usage[g[0]] for g in groups]
        assert all(0.0 <= g[2] < 1.0 for g in groups)
    # 3 sliding lanes: at most the window and a chunk each (+1 for a window across blocks)
    assert sliding_peak <= 3 * (-(-(WINDOW - 1 + chunk) // BS) + 1)
    # the full group keeps every block (measured after each step: the step computing the
    # last token frees them all)
    assert full_peak == -(-(44 + 4) // BS)
    assert engine.num_used_blocks() == 0


def test_abort_storm_returns_every_groups_blocks_to_the_pool(setup):
    path, _ = setup
    from pagedserve import LLM

    rng = random.Random(4)
    llm = LLM(path, dtype="float32", block_size=BS, num_kv_blocks=64, num_cpu_blocks=100,
              preemption_mode="auto", max_num_batched_tokens=12)
    engine = llm.engine
    live = []
    for step in range(40):
        for _ in range(rng.randint(1, 3)):
            rid = f"s{step}-{len(live)}"
            prompt = prompts_of_lengths([rng.randint(3, 40)], seed=rng.randrange(10**6))[0]
            kind = rng.random()
            if kind < 0.2:
                engine.add_beam_request(rid, None, BeamSearchParams(beam_width=2, max_tokens=8),
                                        prompt_token_ids=prompt)
            else:
                n = 3 if kind < 0.4 else 1
                engine.add_request(rid, None, SamplingParams(n=n, temperature=1.0, seed=step,
                                                             max_tokens=rng.randint(4, 30)),
                                   prompt_token_ids=prompt)
            live.append(rid)
        for rid in rng.sample(live, min(len(live), rng.randint(0, 2))):
            engine.abort_request(rid)
            live.remove(rid)
        engine.step()
        engine.check_invariants()
    assert engine.scheduler.num_preemptions > 0
    for rid in live:
        engine.abort_request(rid)
    kv = engine.kv_manager
    assert not engine.has_unfinished_requests()
    assert kv.pool.num_used == 0 and kv.cpu_pool.num_used == 0
    assert kv.group_usage() == [(f"sliding-{WINDOW}", 0), ("full", 0)]
    assert not kv.tables and not kv.cpu_tables
    engine.check_invariants()


def test_per_group_usage_and_waste_are_exported_and_logged(caplog):
    import logging
    import time

    from pagedserve.engine.stats import StatsLogLine, StepStats
    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve.entrypoints.openai.metrics import ServerMetrics

    def metric(text, name, **labels):
        return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == name and s.labels == labels)

    m = ServerMetrics("tiny")
    stats = StepStats(now=0.0, num_running=1, num_waiting=0, kv_usage=0.5, num_used_blocks=4,
                      num_blocks=8, steps=1,
                      kv_groups=[("sliding-512", 0.125, 0.25), ("full", 0.375, 0.0625)])
    m.on_step(stats)
    text = m.render().decode()
    assert metric(text, "pagedserve:kv_cache_group_usage_perc", model_name="tiny",
                  group="sliding-512") == 0.125
    assert metric(text, "pagedserve:kv_cache_group_waste_perc", model_name="tiny",
                  group="full") == 0.0625
    line = StatsLogLine(interval=1.0)
    with caplog.at_level(logging.INFO, logger="pagedserve.stats"):
        line.on_step(stats)
        line.log_if_due(time.monotonic() + 2.0)
    assert "sliding-512 12.5% (waste 25.0%), full 37.5% (waste 6.2%)" in caplog.text
