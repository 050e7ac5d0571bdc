"""Speculative decoding's scheduler side alone (no model): the configuration, the n-gram proposer,
rows of 1 + d tokens with lookahead slots, the rollback of rejected drafts (blocks freed, computed
tokens rewound, the prefix cache fed accepted tokens only), and the per-batch off rule."""

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.core.spec_decode import (SpecDecoder, SpeculativeConfig, make_spec_decoder,
                                         ngram_propose)
from pagedserve.core.step_output import SampleResult, SeqStepOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup

_ids = iter(range(10**6))


def group(rid, prompt, n=1, **params):
    params.setdefault("max_tokens", 100)
    params = SamplingParams(n=n, **params)
    g = SequenceGroup(rid, [Sequence(next(_ids), list(prompt), i) for i in range(n)], params, 0.0)
    g.fork_pending = n > 1
    return g


def make(num_blocks=16, block_size=4, caching=False, **cfg):
    cfg.setdefault("max_model_len", 64)
    cfg.setdefault("max_num_batched_tokens", 64)
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, block_size,
                                                            enable_prefix_caching=caching))


def step(sched, spec, emit):
    """Propose, schedule, and pretend the model ran: `emit(s)` gives the tokens a row emits
    (for a speculative row: its accepted drafts and the next token)."""
    spec.propose(sched.running, sched.max_model_len)
    out = sched.schedule()
    results = [SeqStepOutput(s.seq.seq_id, [SampleResult(t, None, None, None) for t in emit(s)]
                             if s.do_sample else []) for s in out.scheduled]
    update = sched.update_from_output(out, results)
    for seq_id, drafts, accepted in update.spec_rows:
        spec.record(seq_id, drafts, accepted)
    sched.check_invariants()
    return out


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    # "1 2 3" occurred at 0 (-> 9) and at 4 (-> 4 5): the latest wins.
    assert ngram_propose(tokens, 3, 3, 1) == [4, 5, 1]
    assert ngram_propose(tokens, 1, 3, 1) == [4]
    assert ngram_propose([7, 8, 9], 3, 3, 1) == []  # nothing repeats
    assert ngram_propose([5, 6, 5], 4, 2, 1) == [6, 5]  # only the 1-gram "5" occurs earlier
    assert ngram_propose([5, 6, 5], 4, 2, 2) == []
    # Token ids above 255: a byte match across token boundaries is not a token match.
    assert ngram_propose([256, 1, 0, 0, 1], 2, 1, 1) == [0, 0]


def test_speculative_config_parses_vllm_names_and_names_the_bad_field():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                  '"prompt_lookup_max": 5, "prompt_lookup_min": 2}')
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 5, 2)
    assert SpeculativeConfig.parse({"model": "/x", "num_speculative_tokens": 2}).method == \
        "draft_model"
    for bad, name in [({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                      ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                      ({"method": "eagle"}, "method"), ({"k": 1}, "unknown"),
                      ("{not json", "JSON")]:
        with pytest.raises(ValueError, match=name):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="pooling"):
        make_spec_decoder(type("A", (), {"speculative_config": {"method": "ngram"}})(), "pooling")


def test_a_decode_row_carries_its_drafts_in_lookahead_slots_and_rejected_ones_are_given_back():
    sched = make(num_blocks=16, block_size=4)
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2))
    g = group("a", [1, 2, 3, 4, 5, 6, 1, 2])  # "1 2" -> proposes 3 4 5 6
    sched.add(g)
    seq = g.seqs[0]
    step(sched, spec, lambda s: [3])  # the prompt; token 3 sampled: "1 2 3" -> 4 5 6 1
    assert seq.token_ids[-1] == 3 and seq.num_computed_tokens == 8
    out = step(sched, spec, lambda s: [4, 5, 9])  # two drafts accepted, then 9
    [row] = out.scheduled
    assert (row.start, row.end, row.spec_token_ids) == (8, 13, [4, 5, 6, 1])
    # Computed: the real token and the two accepted drafts; the table holds exactly those.
    assert seq.token_ids[8:] == [3, 4, 5, 9] and seq.num_computed_tokens == 11
    table = sched.kv.tables[seq.seq_id]
    assert table.num_tokens == 11 and len(table.blocks) == 3
    assert seq.spec_token_ids == []  # consumed by the step
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 4, 2)
    # "9" never occurred before: nothing proposed, a one-token row.
    out = step(sched, spec, lambda s: [7])
    assert [(s.num_tokens, s.spec_token_ids) for s in out.scheduled] == [(1, [])]
    seq.status = seq.status  # (still running)
    sched.abort("a")
    assert sched.kv.pool.num_used == 0


def test_a_whole_rejected_block_is_freed_and_only_accepted_tokens_reach_the_prefix_cache():
    sched = make(num_blocks=16, block_size=2, caching=True)
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=1))
    g = group("a", [1, 2, 3, 4, 5, 6, 7])
    sched.add(g)
    seq = g.seqs[0]
    step(sched, spec, lambda s: [1])  # 8 tokens: "1" -> proposes 2 3 4 5 6
    before = sched.kv.pool.num_used
    out = step(sched, spec, lambda s: [8])  # every draft rejected
    assert out.scheduled[0].end == 13
    assert seq.num_computed_tokens == 8 and sched.kv.tables[seq.seq_id].num_tokens == 8
    assert sched.kv.pool.num_used == before  # the lookahead blocks went back
    # The cache knows the 4 computed full blocks, not the rejected drafts' block.
    hits = sched.kv.match_prefix([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6])
    assert len(hits) == 4
    sched.abort("a")


def test_lookahead_slots_are_dropped_before_anybody_is_preempted():
    sched = make(num_blocks=5, block_size=4)
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=1))
    a, b = group("a", [1, 2, 3, 4, 5, 6, 7]), group("b", [9, 8, 7, 6, 5, 4, 3])
    sched.add(a)
    sched.add(b)
    step(sched, spec, lambda s: [1 if s.group is a else 9])  # 2 blocks each: 1 free
    assert sched.kv.num_free_blocks == 1
    # Both propose 4 drafts (12 slots: one more block each), but only one block is free: a
    # takes it, b loses its drafts instead of preempting anybody.
    out = step(sched, spec, lambda s: [2] if s.group is a else [8])
    assert [s.num_tokens for s in out.scheduled] == [5, 1] and not out.preempted
    assert sched.kv.num_free_blocks == 1  # a's drafts were rejected: its block came back


def test_the_batch_rule_turns_proposals_off_above_disable_by_batch_size():
    sched = make(num_blocks=32, block_size=4)
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=1,
                                         disable_by_batch_size=1))
    for rid in "ab":
        sched.add(group(rid, [1, 2, 1]))
    step(sched, spec, lambda s: [2])
    out = step(sched, spec, lambda s: [1])
    assert [s.num_tokens for s in out.scheduled] == [1, 1] and spec.num_steps_off == 1
    sched.abort("b")
    out = step(sched, spec, lambda s: [s.spec_token_ids[0], 5] if s.spec_token_ids else [5])
    assert [s.num_tokens for s in out.scheduled] == [3]


def test_drafts_never_take_a_sequence_past_max_tokens():
    sched = make(num_blocks=32, block_size=4)
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_max=1))
    g = group("a", [1, 2, 3, 4, 5, 6, 1], max_tokens=4)
    sched.add(g)
    step(sched, spec, lambda s: [2])  # 1 output token: 3 left, so at most 2 drafts
    out = step(sched, spec, lambda s: s.spec_token_ids + [9] if s.spec_token_ids else [9])
    assert out.scheduled[0].spec_token_ids == [3, 4]
    assert g.seqs[0].output_token_ids == [2, 3, 4, 9] and g.is_finished
    assert sched.kv.pool.num_used == 0


def test_a_forking_parent_never_carries_drafts():
    # Its next token is every sequence's first (found by the stress harness: the siblings were
    # left with nothing to compute).
    sched = make(num_blocks=32, block_size=4, max_num_batched_tokens=7)
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=1))
    g = group("a", [1, 2, 3, 1, 2, 3, 1, 2], n=2, temperature=1.0)
    sched.add(g)
    step(sched, spec, lambda s: [])  # 7 of the 8 prompt tokens: the last one is due next
    out = step(sched, spec, lambda s: [5] * s.num_samples)
    assert [(s.num_tokens, s.spec_token_ids, s.num_samples) for s in out.scheduled] == [(1, [], 2)]
    assert [q.output_token_ids for q in g.seqs] == [[5], [5]]


def test_a_prompts_last_token_never_carries_drafts():
    # Its row may want prompt logprobs (found by the stress harness: the drafts were taken for
    # prompt positions).
    sched = make(num_blocks=32, block_size=4, max_num_batched_tokens=7)
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=1))
    g = group("a", [1, 2, 3, 1, 2, 3, 1, 2], prompt_logprobs=1)
    g.prompt_logprobs = [None]
    sched.add(g)
    step(sched, spec, lambda s: [])
    out = step(sched, spec, lambda s: [5])
    assert [(s.num_tokens, s.spec_token_ids) for s in out.scheduled] == [(1, [])]


def test_a_method_is_its_registry_entry_with_its_hooks(monkeypatch):
    """A new speculative method is a `Proposer` and its registry line: the decoder hands it the
    rows that may speculate (with their limits), takes its drafts, and calls its hooks."""
    from pagedserve.core.proposers import PROPOSERS, Proposer

    calls = []

    class Echo(Proposer):  # drafts: the sequence's last token, repeated
        name = "echo"

        def propose(self, batch):
            calls.append([(seq.seq_id, limit) for seq, limit in batch])
            return [[seq.token_ids[-1]] * (limit + 1) for seq, limit in batch]  # (cut to limit)

        def on_verified(self, seq_id, num_drafts, num_accepted):
            calls.append(("verified", seq_id, num_drafts, num_accepted))

        def on_finished(self, seq_ids):
            calls.append(("finished", sorted(seq_ids)))

    monkeypatch.setitem(PROPOSERS, "echo", Echo)
    spec = SpecDecoder(SpeculativeConfig.parse({"method": "echo", "num_speculative_tokens": 2}))
    sched = make()
    g = group("a", [5, 6, 7], max_tokens=5)
    sched.add(g)
    step(sched, spec, lambda s: [9])  # the prompt: no drafts
    seq = g.seqs[0]
    step(sched, spec, lambda s: [9, 9, 4])  # both drafts accepted, then 4
    assert calls[0] == [(seq.seq_id, 2)] and calls[1] == ("verified", seq.seq_id, 2, 2)
    spec.forget([seq.seq_id])
    assert calls[-1] == ("finished", [seq.seq_id])
    with pytest.raises(ValueError, match="speculative_config.method"):
        SpeculativeConfig.parse({"method": "nope"})
