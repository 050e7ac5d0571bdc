"""Admission (core/admission.py): a waiting group's first plan and the prefix hits it starts
from; every request the engine admits (one sequence alone fits the empty pool) starts."""

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_spec import FullAttentionSpec, KVLayout, RecurrentStateSpec
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from test_scheduler import group, run_step

# a hybrid state model: 2 attention layers, 3 recurrent layers (state in one block each)
LAYOUT = KVLayout.from_specs([FullAttentionSpec(1, 8)] * 2 + [RecurrentStateSpec(1, 8)] * 3)


def test_a_state_snapshot_hit_that_would_not_fit_the_empty_pool_is_not_taken():
    # Found by the scheduler fuzzer (seed 1322452, a hang). B shares A's first 3 tokens, where
    # A's state was snapshotted. Starting from the snapshot takes the cached blocks, the pinned
    # snapshot and B's own state blocks: 3 more than computing B's prompt afresh, and more
    # than the pool holds. B waited for blocks the empty pool never had.
    kv = KVCacheManager(15, 1, layout=LAYOUT, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=16), kv)
    a = group("a", 3, max_tokens=2, ignore_eos=True)
    sched.add(a)
    while sched.has_unfinished():
        run_step(sched)
    b = group("b", 6, n=2, max_tokens=1, ignore_eos=True)  # (its prompt starts with A's)
    assert kv.blocks_for(6, 16) <= kv.num_blocks  # (the engine's admission rule)
    hit = kv.match_prefix(b.seqs[0].token_ids)
    assert kv.hit_tokens(hit) == 3
    sched.add(b)
    out = run_step(sched)
    assert [(s.seq.seq_id, s.start) for s in out.scheduled] == [(b.seqs[0].seq_id, 0)]
    for _ in range(20):
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert [q.num_output_tokens for q in b.seqs] == [1, 1]
    assert kv.pool.num_used == 0

