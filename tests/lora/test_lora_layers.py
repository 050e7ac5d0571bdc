"""The batched LoRA products (lora/layers.py): a gathered step over several slots gives every
token its own adapter's x A^T B^T (base tokens untouched), bit for bit what the token gets in a
batch of its adapter alone."""

from __future__ import annotations

import torch

from pagedserve.lora.layers import LoRAStacks, StepMapping

DIMS = {"q_proj": (32, 48)}
KEY = (0, "q_proj")


def stacks_with(ranks, seed=0):
    g = torch.Generator().manual_seed(seed)
    stacks = LoRAStacks(len(ranks), 8, DIMS, torch.float32, torch.device("cpu"))
    weights = {}
    for slot, r in enumerate(ranks):
        a, b = torch.randn(r, 32, generator=g), torch.randn(48, r, generator=g)
        stacks.put(slot, KEY, a, b)
        weights[slot] = (a, b)
    return stacks, weights


def test_mapping_orders_adapter_tokens_by_slot():
    m = StepMapping.build([1, -1, 0, 1], [2, 3, 1, 2], torch.device("cpu"))
    assert m.single is None and m.perm.tolist() == [5, 0, 1, 6, 7]
    assert m.segments == [(0, 0, 1), (1, 1, 4)]
    assert StepMapping.build([-1, -1], [2, 1], torch.device("cpu")) is None
    assert StepMapping.build([2, 2], [2, 1], torch.device("cpu")).single == 2


def test_each_token_gets_its_own_adapter_and_base_tokens_none():
    stacks, weights = stacks_with([4, 8, 2])
    rows, tokens = [2, -1, 0, 1, 2], [3, 2, 1, 4, 2]
    x = torch.randn(sum(tokens), 32)
    base = torch.randn(sum(tokens), 48)
    stacks.mapping = StepMapping.build(rows, tokens, torch.device("cpu"))
    y = stacks.apply(KEY, x, base.clone())
    start = 0
    for slot, n in zip(rows, tokens):
        want = base[start:start + n]
        if slot >= 0:
            a, b = weights[slot]
            want = want + x[start:start + n] @ a.T @ b.T
        torch.testing.assert_close(y[start:start + n], want)
        if slot < 0:
            assert torch.equal(y[start:start + n], base[start:start + n])
        start += n
    # the first row's tokens alone in a batch of their adapter: the same bits
    stacks.mapping = StepMapping.build([2], [3], torch.device("cpu"))
    alone = stacks.apply(KEY, x[:3], base[:3].clone())
    assert torch.equal(alone, y[:3])


def test_a_slot_that_does_not_adapt_a_projection_leaves_it():
    stacks, _ = stacks_with([4, 4])
    stacks.clear(1)
    x, base = torch.randn(3, 32), torch.randn(3, 48)
    stacks.mapping = StepMapping.build([1, 0], [2, 1], torch.device("cpu"))
    y = stacks.apply(KEY, x, base.clone())
    assert torch.equal(y[:2], base[:2]) and not torch.equal(y[2], base[2])
