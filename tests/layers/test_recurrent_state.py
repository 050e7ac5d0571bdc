"""layers/recurrent_state.py: a recurrent layer's per-sequence state stored in paged cache entries."""

import pytest
import torch

from pagedserve.attention.backends import make_backend
from pagedserve.attention.backends.base import AttentionBatch
from pagedserve.layers.recurrent_state import PagedState


@pytest.fixture(params=["kernels", "torch"], autouse=True)
def path(request, monkeypatch):
    """Every test on the C++ gather / scatter and on the torch fallback."""
    if request.param == "torch":
        monkeypatch.setattr("pagedserve.kernels.cpu_recurrent._get_isa", lambda: None)
    else:
        from pagedserve.kernels.cpu_fp32 import fp32_kernels_available

        if not fp32_kernels_available():
            pytest.skip("no fp32 CPU kernels here")
    return request.param


def _caches(n_entries, num_blocks=8, block_size=4, heads=2, dim=4, dtype=torch.float32):
    shape = (num_blocks + 1, block_size, heads, dim)
    return [(torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
            for _ in range(n_entries)]


def _meta(tables, seq_lens, query_lens, block_size=4):
    return make_backend("torch").build_metadata(AttentionBatch(
        block_tables=tables, seq_lens=seq_lens, query_lens=query_lens, block_size=block_size,
        null_block=8, device="cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_state_round_trips_bit_exactly_through_each_sequences_first_block(dtype):
    state = PagedState([(3, 2), (2, 5, 3)], page=2 * 2 * 4, block_size=4, cache_dtype=dtype)
    per_entry = 4 * 16 * torch.empty((), dtype=dtype).element_size()
    assert state.num_entries == -(-(36 * 4) // per_entry)
    caches = _caches(state.num_entries, dtype=dtype)
    # first step: two fresh sequences (first blocks 5 and 2) read zeros, never the NaN filling
    meta = _meta([[5, 1], [2]], [6, 3], [6, 3])
    got = state.read(caches, [meta] * state.num_entries)
    assert [tuple(t.shape) for t in got] == [(2, 3, 2), (2, 2, 5, 3)]
    assert all(torch.equal(t, torch.zeros_like(t)) for t in got)
    new = [torch.randn(t.shape) for t in got]
    state.write(caches, [meta] * state.num_entries, new)
    # next step, the batch in the other order: each sequence reads its own state back, exactly
    meta = _meta([[2], [5, 1]], [4, 7], [1, 1])
    back = state.read(caches, [meta] * state.num_entries)
    for a, b in zip(back, new):
        assert torch.equal(a[0], b[1]) and torch.equal(a[1], b[0])


def test_a_sequence_with_no_earlier_tokens_reads_zeros_even_from_a_written_block():
    state = PagedState([(4,)], page=4, block_size=4)
    caches = _caches(state.num_entries, heads=1, dim=2)
    meta = _meta([[3]], [2], [2])
    state.write(caches, [meta] * state.num_entries, [torch.ones(1, 4)])
    # a recomputed (preempted) sequence starts again at position 0 in the same block
    again = state.read(caches, [_meta([[3]], [3], [3])] * state.num_entries)
    assert torch.equal(again[0], torch.zeros(1, 4))
    cont = state.read(caches, [_meta([[3]], [3], [1])] * state.num_entries)
    assert torch.equal(cont[0], torch.ones(1, 4))


def test_a_state_given_too_few_cache_entries_is_refused():
    state = PagedState([(100,)], page=4, block_size=4)
    with pytest.raises(ValueError, match="cache entries"):
        state.read(_caches(state.num_entries - 1, heads=1, dim=2), [_meta([[0]], [1], [1])])


def test_each_entry_reads_and_writes_the_block_of_its_own_column():
    # a layer's entries spread over two columns (lanes) of the table: different blocks each
    state = PagedState([(40,)], page=4, block_size=4)
    assert state.num_entries == 3
    caches = _caches(3, heads=1, dim=2)
    first = [_meta([[1]], [2], [2]), _meta([[1]], [2], [2]), _meta([[6]], [2], [2])]
    value = torch.arange(40.0)[None]
    state.write(caches, first, [value])
    # column 2's block is 6: its bytes are there, not in block 1 of that entry's tensors
    assert torch.isnan(caches[2][0][1]).all() and not torch.isnan(caches[2][0][6]).any()
    later = [_meta([[1]], [3], [1]), _meta([[1]], [3], [1]), _meta([[6]], [3], [1])]
    assert torch.equal(state.read(caches, later)[0], value)


def test_a_part_of_the_state_is_read_and_written_alone():
    state = PagedState([(5,), (30,)], page=4, block_size=4)
    caches = _caches(state.num_entries, heads=1, dim=2)
    metas = [_meta([[2], [7]], [3, 3], [3, 3])] * state.num_entries
    conv, rec = torch.randn(2, 5), torch.randn(2, 30)
    state.scatter(caches, metas, 5, rec)  # a fresh state's parts, written one after the other
    state.scatter(caches, metas, 0, conv)
    later = [_meta([[2], [7]], [4, 4], [1, 1])] * state.num_entries
    assert torch.equal(state.gather(caches, later, 5, 30), rec)
    got = state.read(caches, later)
    assert torch.equal(got[0], conv) and torch.equal(got[1], rec)


@pytest.mark.parametrize("kind", ["gdr", "ssm"])
def test_in_place_kernels_give_the_bits_of_gather_compute_scatter(kind, path):
    from pagedserve.kernels import cpu_recurrent as rec

    if path == "torch":
        pytest.skip("kernels only")
    g = torch.Generator().manual_seed(4)
    shapes = [(6, 3), (3, 8, 16)] if kind == "gdr" else [(6, 3), (4, 8, 16)]
    state = PagedState(shapes, page=2 * 2 * 4, block_size=4)
    caches = _caches(state.num_entries, num_blocks=12)
    # step 1: two fresh sequences (3 and 2 tokens) over NaN-filled blocks
    steps = [([[5, 1], [2]], [3, 2], [3, 2]), ([[5, 1], [2]], [5, 4], [2, 2]), ([[2], [5, 1]], [5, 6], [1, 1])]
    copies = [(c[0].clone(), c[1].clone()) for c in caches]
    for tables, lens, qlens in steps:
        metas = [_meta(tables, lens, qlens)] * state.num_entries
        t = sum(qlens)
        qsl = metas[0].query_start_loc
        if kind == "gdr":
            ins = (torch.randn(t, 3, 8, generator=g), torch.randn(t, 3, 8, generator=g),
                   torch.randn(t, 3, 16, generator=g), torch.rand(t, 3, generator=g), torch.rand(t, 3, generator=g))
            flat, blocks, fresh = state.paged(caches, metas)
            out = rec.gated_delta_rule_paged(*ins, flat, blocks, state.offset(1), fresh, qsl)
            conv, st = state.read(copies, metas)
            st = st.contiguous()
            ref = rec.gated_delta_rule(*ins, st, qsl)
        else:
            ins = (torch.randn(t, 4, 8, generator=g), torch.rand(t, 4, generator=g), -torch.rand(4, generator=g),
                   torch.randn(t, 2, 16, generator=g), torch.randn(t, 2, 16, generator=g), torch.randn(4, generator=g))
            flat, blocks, fresh = state.paged(caches, metas)
            out = rec.ssm_scan_paged(*ins, flat, blocks, state.offset(1), fresh, qsl)
            conv, st = state.read(copies, metas)
            st = st.contiguous()
            ref = rec.ssm_scan(*ins, st, qsl)
        state.write(copies, metas, [conv, st])
        assert torch.equal(out, ref)
        assert torch.equal(state.gather(caches, metas, state.offset(1), st[0].numel()),
                           state.gather(copies, metas, state.offset(1), st[0].numel()))


def test_block_ids_of_state_columns_come_from_one_shared_index(path):
    # a flat table row of 4 columns (0: attention, 1-3: state), two sequences of 2 logical blocks
    tables = [[10, 11, 12, 13, 20, 8, 8, 8], [30, 31, 32, 33, 40, 8, 8, 8]]
    meta = make_backend("torch").build_metadata(AttentionBatch(
        block_tables=tables, seq_lens=[6, 7], query_lens=[1, 1], block_size=4, null_block=8,
        device="cpu", width=4, layer_columns=(0, 1, 2, 3), state_columns=(1, 2, 3)))
    metas = [meta.per_layer[c] for c in (2, 3, 3)]  # a layer's entries: columns 2, 3, 3
    ids = PagedState.block_ids(metas)
    assert ids.tolist() == [[12, 32], [13, 33], [13, 33]]
    assert PagedState.block_ids(metas) is ids  # (computed once per step and layer)
    assert torch.equal(ids, torch.stack([m.block_tables[:, 0] for m in metas]))
