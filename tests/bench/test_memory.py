"""`bench memory`: the KV usage breakdown and sharing savings on the engine's scheduler and the
real block managers."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.bench import memory
from pagedserve.bench.memory import (
    CATEGORIES,
    LengthRequest,
    length_trace,
    memory_breakdown,
    parallel_sampling_savings,
    reservation,
    simulate_contiguous,
    simulate_paged,
    scheduler_for,
)
from pagedserve.config import EngineArgs
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.entrypoints.cli import main as cli_main

POOL = 4096  # token slots: 256 blocks of 16


@pytest.fixture(scope="module")
def sharegpt():
    return length_trace("sharegpt", 60, seed=0, max_model_len=2048)


@pytest.fixture(scope="module")
def breakdown(sharegpt):
    return memory_breakdown(sharegpt, POOL)


def test_length_trace_is_seeded_and_fits_max_model_len():
    a = length_trace("alpaca", 300, seed=1, max_model_len=512)
    assert a == length_trace("alpaca", 300, seed=1, max_model_len=512)
    assert a != length_trace("alpaca", 300, seed=2, max_model_len=512)
    assert all(1 <= r.prompt_len and 1 <= r.output_len and r.total_len <= 512 for r in a)
    assert 12 < sum(r.prompt_len for r in a) / len(a) < 27
    with pytest.raises(ValueError):
        length_trace("nope", 3)
    with pytest.raises(ValueError):
        length_trace("alpaca", 0)


def test_paged_keeps_at_least_96_percent_of_used_memory_in_token_states(breakdown):
    shares = breakdown["paged"].breakdown.shares()
    assert shares["token states"] >= 0.96
    assert shares["external frag"] == 0.0


def test_contiguous_max_wastes_most_memory_and_the_order_matches_the_paper(breakdown):
    token = {name: r.breakdown.shares()["token states"] for name, r in breakdown.items()}
    assert token["max"] < 0.4
    shares = breakdown["max"].breakdown.shares()
    assert shares["reservation"] + shares["internal frag"] + shares["external frag"] > 0.5
    assert token["max"] < token["pow2"] < token["oracle"] < token["paged"]
    # Oracle reserves exactly prompt + output: its only internal fragmentation is the rounding
    # of a reservation up to whole blocks (< 1 block of 16 per request of ~500 tokens).
    oracle = breakdown["oracle"].breakdown.shares()
    assert 0 < oracle["internal frag"] < 0.05
    assert oracle["internal frag"] < breakdown["pow2"].breakdown.shares()["internal frag"]


def test_categories_sum_to_one_per_allocator(breakdown):
    for name, result in breakdown.items():
        shares = result.breakdown.shares()
        assert set(shares) == set(CATEGORIES)
        assert sum(shares.values()) == pytest.approx(1.0), name
        assert all(v >= 0 for v in shares.values()), name
        assert result.breakdown.steps > 0


def test_every_simulation_ends_with_an_empty_pool(breakdown, sharegpt):
    for result in breakdown.values():
        assert result.final_free_slots == POOL
    for result in parallel_sampling_savings(sharegpt[:20], 4 * POOL, ns=(3,)).values():
        assert result.final_free_slots == 4 * POOL


def test_paged_preempts_under_pressure_and_still_finishes():
    reqs = [LengthRequest(40, 200)] * 6
    result = simulate_paged(reqs, 64 * 16, block_size=16)
    assert result.preemptions > 0
    assert result.final_free_slots == 64 * 16


def test_parallel_sampling_savings_are_positive_and_grow_with_n(sharegpt):
    runs = parallel_sampling_savings(sharegpt[:30], 4 * POOL, ns=(1, 2, 4, 6))
    savings = [runs[n].sharing_savings for n in (1, 2, 4, 6)]
    assert savings[0] == 0.0
    assert 0 < savings[1] < savings[2] < savings[3] < 1
    assert runs[2].cow_copies > 0  # partial prompt blocks were copied on write


def test_sharing_counts_a_shared_prompt_once():
    # 32-token prompt = 2 full blocks, computed once by the parent, whose first step samples both
    # first tokens; then each of the 2 samples writes 1 token into a block of its own.
    result = simulate_paged([LengthRequest(32, 2)], 16 * 16, block_size=16, n=2)
    assert result.used_block_steps == 2 + 4  # prefill step: 2 blocks; decode step: 2 + 2
    assert result.unshared_block_steps == 2 + 6  # the children hold no table before the fork
    assert result.cow_copies == 0


def test_the_simulation_runs_the_engines_scheduler_policy():
    # The same limits, chunking and preemption policy as an engine built with the defaults
    # (`bench paper` and serving), recomputation instead of swapping (no swap pool), and a
    # token budget of the whole pool (memory, not compute, bounds the batch).
    config = scheduler_for(KVCacheManager(256, 16), 2048).config
    defaults = EngineArgs()
    assert config.max_num_seqs == defaults.max_num_seqs
    assert config.enable_chunked_prefill == defaults.enable_chunked_prefill
    assert config == EngineArgs(preemption_mode="recompute",
                                max_num_batched_tokens=4096).scheduler_config(2048)
    # Prompts are prefilled within the budget: 3000 tokens in one step, then 3 decode steps.
    result = simulate_paged([LengthRequest(3000, 4)], 4096, max_model_len=4096)
    assert result.steps == 1 + 3


def test_reservations_and_bad_arguments():
    r = LengthRequest(100, 30)
    assert reservation("max", r, 2048) == 2048
    assert reservation("oracle", r, 2048) == 130
    assert reservation("pow2", r, 2048) == 100 + 32  # the paper's: prompt + pow2(output)
    with pytest.raises(ValueError):
        reservation("best", r, 2048)
    with pytest.raises(ValueError):
        simulate_paged([r], POOL, n=0)
    with pytest.raises(ValueError):
        simulate_paged([LengthRequest(5000, 10)], POOL)
    with pytest.raises(ValueError):
        simulate_contiguous([r], 1024, "max")
    with pytest.raises(ValueError):
        simulate_contiguous([r], POOL, "oracle", busy_threshold=0)


def test_cli_runs_on_tiny_settings_and_writes_the_charts(tmp_path, capsys):
    import tiny

    model = tiny.make_checkpoint(tmp_path / "m", "llama")
    b, s = tmp_path / "breakdown.png", tmp_path / "sharing.png"
    assert cli_main(["bench", "memory", "--num-requests", "40", "--pool-tokens", "2048",
                     "--max-model-len", "512",
                     "--parallel-n", "2", "4", "--breakdown-plot", str(b),
                     "--sharing-plot", str(s), "--model", str(model), "--dtype", "float32",
                     "--beam-widths", "2", "3", "--beam-requests", "3",
                     "--beam-max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    for label in memory.LABELS.values():
        assert label in out
    assert "(2) parallel sampling" in out and "(3) beam search" in out
    beam_rows = [line.split() for line in out.splitlines()
                 if line.split()[:1] in (["sharegpt"], ["alpaca"]) and len(line.split()) >= 4
                 and line.split()[1] in ("2", "3") and "beam" not in line]
    savings = [float(r[2].rstrip("%")) for r in beam_rows[-4:]]
    assert all(x > 0 for x in savings)  # beams share their prompt and common prefixes
    assert b.stat().st_size > 1000 and s.stat().st_size > 1000
    assert cli_main(["bench", "memory", "--num-requests", "0"]) == 2


def test_layer_groups_hold_more_long_prompts_than_one_group(checkpoints, capsys):
    """(4), issue 36: a model mixing sliding-window and full layers (the tiny Gemma 3: three
    layers of window 6, one full) holds more long prompts at once in the same bytes on its
    layer groups than on one group of full attention; each group's share and waste printed."""
    model = checkpoints("gemma3")
    runs = memory.layer_groups_experiment(str(model), 4, 1 << 18, prompt_len=120, output_len=40,
                                          num_requests=10, block_size=4,
                                          max_num_batched_tokens=32)
    one, groups = runs["one group"], runs["layer groups"]
    assert groups.num_blocks == 4 * one.num_blocks + 3  # blocks of one layer, not of four
    assert (one.peak_running, groups.peak_running) == (2, 6)
    assert groups.peak_running > 2 * one.peak_running
    assert groups.max_concurrency > 2 * one.max_concurrency
    assert [g[0] for g in groups.groups] == ["sliding-6", "full"]
    assert all(0 < share < 1 and 0 <= waste < 1 for _, share, waste in groups.groups)
    assert cli_main(["bench", "memory", "--only-groups", "--model", str(model), "--dtype",
                     "float32", "--kv-cache-memory", str(1 << 18), "--group-prompt-len", "120",
                     "--group-output-len", "8", "--group-requests", "3", "--block-size", "4",
                     "--group-batched-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "(4) KV layer groups" in out and "sliding-6" in out and "layer groups" in out
    # --kv-cache-dtype fp8: blocks of one byte a value, a quarter of float32's (half of bf16's)
    def block_kib(text):
        return [float(line.split()[3]) for line in text.splitlines()
                if line.startswith(("one group", "layer groups"))]

    assert cli_main(["bench", "memory", "--only-groups", "--model", str(model), "--dtype",
                     "float32", "--kv-cache-dtype", "fp8", "--kv-cache-memory", str(1 << 18),
                     "--group-prompt-len", "120", "--group-output-len", "8", "--group-requests",
                     "3", "--block-size", "4", "--group-batched-tokens", "32"]) == 0
    fp8 = capsys.readouterr().out
    assert "float8_e4m3fn" in fp8
    assert [4 * k for k in block_kib(fp8)] == pytest.approx(block_kib(out), abs=0.2)
