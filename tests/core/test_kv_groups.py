"""KV cache specs per layer group (core/kv_spec.py) and the block manager over several groups:
one pool of equal-size blocks, a flat table row per sequence (a block per column), sliding-window
groups giving back what their window left, forks, copy-on-write, swapping and prefix caching per
group, and the invariants that check all of it."""

import random

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_spec import FullAttentionSpec, KVLayout, MLASpec, SlidingWindowSpec

FULL = FullAttentionSpec(1, 256)
SLIDE = SlidingWindowSpec(1, 256, window=512)


def gemma3_270m_specs():
    # 18 layers, every 6th full attention, the others a window of 512
    return [FULL if (i + 1) % 6 == 0 else SLIDE for i in range(18)]


def test_gemma3_270m_takes_three_layers_per_block_five_sliding_lanes_and_one_full():
    layout = KVLayout.from_specs(gemma3_270m_specs())
    assert layout.slots == 3 and layout.width == 6
    (sliding, full) = layout.groups
    assert sliding.window == 512 and sliding.lanes == 5 and len(sliding.layers) == 15
    assert full.window is None and full.lanes == 1 and full.layers == (5, 11, 17)
    # every (column, slot) pair serves one layer exactly
    assert len(set(zip(layout.layer_column, layout.layer_slot))) == 18
    assert layout.bytes_per_block(16, 2) == 3 * 16 * 2 * 256 * 2
    # vLLM's maximum concurrency rule: 8192 tokens, chunks of 2048
    assert layout.blocks_per_request(8192, 16, 2048) == 512 + 5 * (-(-(511 + 2048) // 16) + 1)


def test_layouts_of_one_group_are_todays_cache():
    uniform = KVLayout.from_specs([FULL] * 4)
    assert uniform.width == 1 and uniform.slots == 4 and uniform.layer_column == (0,) * 4
    off = KVLayout.from_specs(gemma3_270m_specs(), hybrid=False)
    assert off.width == 1 and off.slots == 18 and off.groups[0].window is None
    mistral = KVLayout.from_specs([SLIDE] * 3)
    assert mistral.width == 1 and mistral.groups[0].window == 512
    # padding: 22 sliding + 4 full layers take 4 layers a block (2 slots of 28 unused)
    gemma3_1b = KVLayout.from_specs([SLIDE] * 22 + [FULL] * 4)
    assert gemma3_1b.slots == 4 and gemma3_1b.width == 7


def test_latent_attention_keeps_one_vector_per_token_and_page_shapes_must_agree():
    mla = KVLayout.from_specs([MLASpec(576)] * 3)
    assert mla.page_spec.bytes_per_token(2) == 576 * 2 and mla.page_spec.num_tensors == 1
    assert mla.bytes_per_block(16, 2) == 3 * 16 * 576 * 2
    with pytest.raises(ValueError, match="page shapes"):
        KVLayout.from_specs([FULL, FullAttentionSpec(2, 256)])
    with pytest.raises(ValueError, match="window"):
        SlidingWindowSpec(1, 64, window=0)
    assert FullAttentionSpec(1, 64, sinks=True).rule() == FULL.rule()  # sinks: no memory rule


def _manager(num_blocks=400, block_size=4, window=6, sliding=3, full=1, **kw):
    specs = [SlidingWindowSpec(1, 32, window=window)] * sliding + [FullAttentionSpec(1, 32)] * full
    return KVCacheManager(num_blocks, block_size, layout=KVLayout.from_specs(specs), **kw)


def _run(kv, seq_id, length, chunk):
    """Compute `length` tokens of a sequence in chunks, as the scheduler and step update do;
    returns the most blocks it held at once."""
    done, peak = 0, 0
    while done < length:
        end = min(length, done + chunk)
        assert kv.num_new_blocks(seq_id, end) <= kv.num_free_blocks
        kv.allocate_slots(seq_id, end)
        peak = max(peak, kv.pool.num_used)
        done = end
        kv.free_out_of_window(seq_id, done)
        kv.check_invariants()
    return peak


@pytest.mark.parametrize("chunk", [1, 3, 5, 16])
def test_a_sliding_group_holds_at_most_its_window_and_a_chunk(chunk):
    kv = _manager(window=6)
    peak = _run(kv, 0, 97, chunk)
    assert peak <= kv.blocks_for(97, chunk)  # the engine's admission bound holds
    table = kv.tables[0]
    rows = len(table.blocks) // kv.width
    assert rows == 25
    # full column: every block; sliding columns: only the blocks the next query reaches
    assert kv.null not in table.blocks[3::4]
    first_needed = (97 - 6 + 1) // 4
    for c in range(3):
        assert table.blocks[c::4][:first_needed] == [kv.null] * first_needed
        assert kv.null not in table.blocks[c::4][first_needed:]
    assert kv.pool.num_used == 25 + 3 * (rows - first_needed)
    assert dict(kv.group_usage()) == {"sliding-6": 3 * (rows - first_needed), "full": 25}
    kv.free(0)
    assert kv.pool.num_used == 0 and kv.group_usage() == [("sliding-6", 0), ("full", 0)]
    kv.check_invariants()


def test_blocks_for_bounds_every_schedule_of_chunks():
    rng = random.Random(0)
    for _ in range(200):
        bs, window, cap = rng.choice([1, 2, 4, 16]), rng.randint(1, 40), rng.randint(1, 30)
        kv = _manager(num_blocks=2000, block_size=bs, window=window, sliding=2, full=1)
        length, done, peak = rng.randint(1, 120), 0, 0
        while done < length:
            done = min(length, done + rng.randint(1, cap))
            kv.allocate_slots(0, done)
            peak = max(peak, kv.pool.num_used)
            kv.free_out_of_window(0, done)
        assert peak <= kv.blocks_for(length, cap), (bs, window, cap, length)


def test_fork_copy_on_write_and_restore_per_column():
    kv = _manager(window=5)
    _run(kv, 0, 10, 10)  # 3 rows; sliding columns gave back row 0
    kv.fork(0, 1)
    kv.check_invariants()
    before = kv.num_free_blocks
    snap = kv.snapshot(1)
    assert kv.num_new_blocks(1, 11) == 4  # the shared partial last row: one copy per column
    copies = kv.allocate_slots(1, 11)
    assert len(copies) == 4 and kv.num_free_blocks == before - 4
    kv.check_invariants()
    kv.restore(1, snap)  # undone: the shared row is held again, the copies released
    assert kv.num_free_blocks == before and kv.tables[1].blocks == kv.tables[0].blocks
    kv.check_invariants()
    kv.allocate_slots(1, 13)  # copy-on-write, then a new row
    kv.free_out_of_window(1, 13)
    kv.check_invariants()
    kv.free(0)
    kv.free(1)
    assert kv.pool.num_used == 0
    kv.check_invariants()


def test_swap_keeps_the_given_back_entries_and_moves_only_held_blocks():
    kv = _manager(window=5, num_cpu_blocks=100)
    _run(kv, 0, 21, 4)
    held = kv.pool.num_used
    assert kv.num_distinct_blocks([0]) == held
    pairs = kv.swap_out([0])
    assert len(pairs) == held and kv.pool.num_used == 0 and kv.cpu_pool.num_used == held
    kv.check_invariants()
    low = list(kv.cpu_tables[0].low)
    assert kv.num_swap_in_growth(0, 22) == 4  # the copy-on-write bound of its last row
    back = kv.swap_in([0])
    assert len(back) == held and kv.cpu_pool.num_used == 0 and kv.tables[0].low == low
    kv.check_invariants()
    kv.allocate_slots(0, 22)
    kv.free_out_of_window(0, 22)
    kv.check_invariants()


def test_prefix_hit_needs_every_full_block_and_the_sliding_blocks_of_its_window():
    kv = _manager(window=6, enable_prefix_caching=True, num_blocks=200)
    tokens = list(range(100, 130))  # 30 tokens: 7 full rows
    done = 0
    while done < len(tokens):  # computed in chunks: the cache takes each row once full
        done = min(len(tokens), done + 4)
        kv.allocate_slots(0, done)
        kv.cache_full_blocks(0, tokens, done)
        kv.free_out_of_window(0, done)
    kv.free(0)
    hit = kv.match_prefix(tokens + [7])  # the 30 tokens' 7 rows are all cached, the last kept
    assert len(hit) == 7 * 4
    assert kv.hit_tokens(hit) == 28
    lo = (28 - 6 + 1) // 4  # rows before the window of the hit's end come back null
    for c in range(3):
        assert hit[c::4] == [kv.null] * lo + hit[c::4][lo:] and kv.null not in hit[c::4][lo:]
    assert kv.null not in hit[3::4]
    assert kv.num_blocks_to_map(31, hit) == 4 + kv.num_free_among(hit)
    kv.use_prefix(1, hit)
    assert kv.tables[1].low == [lo]  # (one sliding group of three lanes)
    kv.check_invariants()
    kv.cache_full_blocks(1, tokens + [7], 28)  # the hashes of the hit continue the chain
    kv.free(1)
    # a sliding block inside the window forgotten (the pool hands it out again): the hit ends
    # before its row, where the window of the end needs rows 4 and 5 only
    kv._forget(hit[6 * 4 + 1])
    shorter = kv.match_prefix(tokens + [7])
    assert len(shorter) == 6 * 4 and shorter[3::4] == hit[3::4][:6]
    # another salt shares nothing
    assert kv.match_prefix(tokens + [7], salt="other") == []
    kv.check_invariants()


def test_shareable_prefix_of_a_sibling_stops_where_its_window_gave_blocks_back():
    kv = _manager(window=5)
    _run(kv, 0, 24, 24)  # 6 rows, sliding columns keep rows 5 (and 4) only
    shared = kv.shareable_prefix(0, 6)
    assert len(shared) == 6 * 4  # the end of its table: the window's blocks are there
    short = kv.shareable_prefix(0, 3)
    assert short == []  # rows 0-2 of its sliding columns are gone: nothing to start from
    kv.share_blocks(1, shared)
    kv.check_invariants()
    kv.free(0)
    kv.free(1)
    assert kv.pool.num_used == 0


def test_invariants_catch_a_null_entry_in_a_full_column_and_a_wrong_group_count():
    kv = _manager(window=5)
    _run(kv, 0, 12, 4)
    table = kv.tables[0]
    block = table.blocks[3]
    table.blocks[3] = kv.null
    with pytest.raises(RuntimeError, match="null"):
        kv.check_invariants()
    table.blocks[3] = block
    kv.check_invariants()
    kv.pool.used_by_tag[0] += 1
    with pytest.raises(RuntimeError, match="per group"):
        kv.check_invariants()
