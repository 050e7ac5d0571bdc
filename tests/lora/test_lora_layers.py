"""The batched LoRA products (lora/layers.py): one gathered shrink and one expand give every
token its own adapter's x A^T B^T and base tokens nothing, bit for bit what the token gets alone,
in any slot, with a slot table of any size."""

from __future__ import annotations

import pytest
import torch

from pagedserve.lora.layers import LoRAStacks, StepMapping

KEY = (0, "q_proj")
DIMS = {KEY: (64, 96)}  # (layer, module): (in, out)
CPU = torch.device("cpu")


def adapter(r, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, 64, generator=g) * 0.2, torch.randn(96, r, generator=g)


def stacks_of(num_slots, placed, dtype=torch.float32):
    """A table of `num_slots` slots with adapter (rank, seed) placed[slot] in each slot."""
    stacks = LoRAStacks(num_slots, 16, DIMS, dtype, CPU)
    for slot, (r, seed) in placed.items():
        a, b = adapter(r, seed)
        stacks.put(slot, KEY, a.to(dtype), b.to(dtype))
    return stacks


def run(stacks, rows, tokens, x, base):
    stacks.set_mapping(StepMapping.build(rows, tokens, stacks.num_slots, x.dtype, CPU,
                                         bgmv=stacks.bgmv))
    return stacks.apply(KEY, x, base.clone())


def test_the_mapping_is_a_one_hot_mask_per_token():
    m = StepMapping.build([1, -1, 0], [2, 1, 1], 3, torch.float32, CPU)
    assert m.mask.squeeze(-1).tolist() == [[0, 1, 0], [0, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert m.slots == {0, 1}
    big = StepMapping.build([1, -1, 0], [40, 10, 30], 3, torch.float32, CPU)  # segmented
    assert big.mask is None and big.segments == ((0, 0, 30), (1, 30, 40))
    assert big.perm.tolist() == list(range(50, 80)) + list(range(40))
    assert StepMapping.build([-1, -1], [2, 1], 3, torch.float32, CPU) is None


def bgmv_here() -> bool:
    return stacks_of(1, {}, torch.bfloat16).bgmv


@pytest.mark.parametrize("scale,dtype", [(1, torch.float32), (8, torch.float32),
                                         (1, torch.bfloat16), (8, torch.bfloat16)],
                         ids=["dense", "segmented", "bgmv decode", "bgmv prompts"])
def test_each_token_gets_its_own_adapter_and_base_tokens_none(scale, dtype):
    if dtype is torch.bfloat16 and not bgmv_here():
        pytest.skip("no per-token LoRA kernels here (bf16 runs the torch paths)")
    placed = {0: (8, 1), 1: (16, 2), 2: (4, 3)}
    stacks = stacks_of(3, placed, dtype)
    assert stacks.bgmv == (dtype is torch.bfloat16)
    rows, tokens = [2, -1, 0, 1, 2], [3 * scale, 2 * scale, scale, 4 * scale, 2 * scale]
    x, base = torch.randn(12 * scale, 64).to(dtype), torch.randn(12 * scale, 96).to(dtype)
    y = run(stacks, rows, tokens, x, base)
    start = 0
    for slot, n in zip(rows, tokens):
        want = base[start:start + n].double()
        if slot >= 0:
            a, b = (t.to(dtype).double() for t in adapter(*placed[slot]))
            want = want + x[start:start + n].double() @ a.T @ b.T
            tol = dict(rtol=1e-4, atol=1e-4) if dtype is torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
            torch.testing.assert_close(y[start:start + n].double(), want, **tol)
        else:
            assert torch.equal(y[start:start + n], base[start:start + n])
        start += n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_bits_do_not_depend_on_its_batch_slot_table_size_or_path(dtype):
    x, base = torch.randn(2010, 64).to(dtype), torch.randn(2010, 96).to(dtype)
    alone = run(stacks_of(1, {0: (8, 1)}, dtype), [0], [3], x[:3], base[:3])  # dense
    for num_slots in (2, 4):
        for slot in range(num_slots):
            placed = {s: (16, 10 + s) for s in range(num_slots)}
            placed[slot] = (8, 1)
            others = [s for s in range(num_slots) if s != slot] + [-1]
            stacks = stacks_of(num_slots, placed, dtype)
            # a dense step, a segmented one; the per-token kernels (bf16): one thread, several
            for other_tokens in (4, 80, 2000):
                y = run(stacks, [slot, others[0], others[-1]], [3, other_tokens, 2],
                        x[:5 + other_tokens], base[:5 + other_tokens])
                assert torch.equal(y[:3], alone), (num_slots, slot, other_tokens)


def test_a_cleared_slot_adapts_nothing():
    stacks = stacks_of(2, {0: (4, 1), 1: (4, 2)})
    stacks.clear(1)
    x, base = torch.randn(3, 64), torch.randn(3, 96)
    y = run(stacks, [1, 0], [2, 1], x, base)
    assert torch.equal(y[:2], base[:2]) and not torch.equal(y[2], base[2])
    assert run(stacks, [1], [3], x, base).equal(base)  # no slot of the step adapts it


def test_projections_of_one_input_share_the_shrink_with_the_same_bits():
    dims = {(0, "q_proj"): (64, 96), (0, "k_proj"): (64, 32)}
    stacks = LoRAStacks(2, 16, dims, torch.float32, CPU)
    g = torch.Generator().manual_seed(5)
    for slot in (0, 1):
        for key, (d_in, d_out) in dims.items():
            stacks.put(slot, key, torch.randn(8, d_in, generator=g),
                       torch.randn(d_out, 8, generator=g))
    x, yq, yk = torch.randn(5, 64), torch.randn(5, 96), torch.randn(5, 32)
    stacks.set_mapping(StepMapping.build([0, 1], [2, 3], 2, torch.float32, CPU))
    q = stacks.apply((0, "q_proj"), x, yq.clone())
    k = stacks.apply((0, "k_proj"), x, yk.clone())  # the shrink of q reused
    stacks.set_mapping(StepMapping.build([0, 1], [2, 3], 2, torch.float32, CPU))
    assert torch.equal(stacks.apply((0, "k_proj"), x, yk.clone()), k)  # computed afresh
    a, b = stacks.a[(0, "qkv")][0, 16:24], stacks.b[(0, "k_proj")][:, 0, :8]  # k's slot-0 block
    torch.testing.assert_close(k[:2], yk[:2] + x[:2] @ a.T @ b.T, rtol=1e-4, atol=1e-4)
    assert not torch.equal(q, yq)
