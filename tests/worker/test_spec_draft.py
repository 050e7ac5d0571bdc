"""The draft model's proposer (worker/spec_draft.py): a speculative row's draft slots are filled
with the draft model's greedy continuation, computed over its own paged KV cache, and the draft
has then written the K/V of every position of the row (as the target does), so that the two
caches always hold the same positions."""

from __future__ import annotations

import torch

import tiny
from pagedserve.core.spec_decode import DRAFT_SLOT
from pagedserve.core.step_input import SampleSpec, StepInput, StepRow
from pagedserve.models.loader import load_model
from pagedserve.platforms import platform_for
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.kv_cache import KVCache
from pagedserve.worker.spec_draft import DraftProposer, wants_draft

BS = 4


def proposer(num_blocks=16):
    model = load_model(tiny.config_for("llama", num_hidden_layers=1), weights=None,
                       dtype=torch.float32, seed=3)
    cache = KVCache(model.kv_cache_spec, num_blocks, BS, torch.float32, torch.device("cpu"))
    cache.fill_blocks(list(range(num_blocks)), float("nan"))  # an unwritten slot reads NaN
    return DraftProposer(model, cache, platform_for("cpu").attention_backend("torch"),
                         torch.device("cpu"))


def row(tokens, num_prompt, start, end, table, drafts=()):
    return StepRow("r", 0, tokens, num_prompt, start, end, table, SamplingParams(temperature=0),
                   do_sample=True, samples=[SampleSpec(0, 0, tokens, num_prompt)],
                   spec_token_ids=list(drafts))


def greedy_continuation(model, tokens, n):
    """The draft's greedy tokens after `tokens`, each from a fresh full forward (no cache)."""
    out = list(tokens)
    for _ in range(n):
        runner = proposer()  # a clean cache each time
        runner.model = model
        ids = torch.tensor(out)
        meta = runner.attention.build_metadata(_batch(len(out)))
        hidden = model(ids, torch.arange(len(out)), runner.kv_cache.layers, meta)
        out.append(int(model.compute_logits(hidden[-1:]).float().argmax()))
    return out[len(tokens):]


def _batch(n):
    from pagedserve.attention.backends.base import AttentionBatch

    return AttentionBatch(block_tables=[list(range(-(-n // BS)))], seq_lens=[n], query_lens=[n],
                          block_size=BS, null_block=16, device=torch.device("cpu"))


def test_draft_slots_are_filled_with_the_greedy_continuation_and_every_position_is_written():
    p = proposer()
    prompt = [5, 17, 200, 33, 9, 101]
    table = [11, 2, 7]
    p.propose(StepInput([row(prompt, 6, 0, 6, table[:2])]))  # the prompt: K/V only
    tokens = prompt + [42]  # the token the target sampled last
    r = row(tokens, 6, 6, 7 + 3, table, [DRAFT_SLOT] * 3)
    slots = r.spec_token_ids
    p.propose(StepInput([r]))
    assert r.spec_token_ids == greedy_continuation(p.model, tokens, 3)
    assert slots == [DRAFT_SLOT] * 3  # the row's own list is not touched: a new one
    assert not wants_draft(r)
    # every position 0 .. 9 of the row written (the last draft's K/V too), nothing past it
    k = p.kv_cache.layers[0][0]
    written = [not torch.isnan(k[table[pos // BS], pos % BS]).any() for pos in range(12)]
    assert written == [True] * 10 + [False] * 2
    assert p.seconds > 0


def test_rows_without_draft_slots_have_their_tokens_written_and_keep_their_drafts():
    p = proposer()
    tokens = [5, 17, 200, 33, 9]
    ngram = row(tokens, 3, 0, 5 + 2, [4, 9], [7, 8])  # drafts from the n-gram proposer
    p.propose(StepInput([ngram]))
    assert ngram.spec_token_ids == [7, 8]
    k = p.kv_cache.layers[0][0]
    assert [not torch.isnan(k[[4, 9][pos // BS], pos % BS]).any() for pos in range(8)] == (
        [True] * 7 + [False])


def test_block_operations_move_the_draft_cache_as_the_target_cache():
    p = proposer()
    cache = KVCache(p.model.kv_cache_spec, 16, BS, torch.float32, torch.device("cpu"),
                    num_cpu_blocks=4)
    p.kv_cache = cache
    k = cache.layers[0][0]
    k[3] = 1.0
    k[5] = 2.0
    p.apply_block_ops(StepInput(blocks_to_swap_out=[(3, 0)], blocks_to_swap_in=[(0, 8)],
                                blocks_to_copy=[(5, 6)]))
    assert bool((k[8] == 1.0).all()) and bool((k[6] == 2.0).all())


def test_the_kv_budget_pays_for_the_draft_cache_too():
    from pagedserve.models.base import KVCacheSpec
    from pagedserve.worker.kv_cache import bytes_per_block, num_blocks_for_budget

    target, draft = KVCacheSpec(4, 2, 16), KVCacheSpec(1, 1, 16)
    one, both = (bytes_per_block(target, BS, torch.float32, d) for d in (None, draft))
    assert both == one + bytes_per_block(draft, BS, torch.float32) == one * 9 // 8
    budget = 100 * both
    assert num_blocks_for_budget(target, BS, torch.float32, budget, draft=draft) == 99
    assert num_blocks_for_budget(target, BS, torch.float32, budget) > 99
