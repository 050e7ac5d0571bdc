"""`StepInput.from_schedule`: the rows the workers see, field by field.

NOTE: from_schedule builds its rows positionally (issue 25: half the cost of keywords), so a
field added to or moved in `StepRow` must keep these values where their names say."""

from pagedserve.core.step_input import SampleSpec, StepInput
from test_scheduler import group, make, run_step


def test_rows_carry_each_field_under_its_name():
    sched = make(num_blocks=16, block_size=4)
    a = group("a", 5, logprobs=1, prompt_logprobs=2)
    b = group("b", 3, n=2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    rows = StepInput.from_schedule(out).rows
    ra, rb = rows
    seq = a.seqs[0]
    assert (ra.request_id, ra.seq_id, ra.token_ids, ra.num_prompt_tokens) == (
        "a", seq.seq_id, seq.token_ids, 5)
    assert (ra.start, ra.end, ra.block_table) == (0, 5, sched.kv.tables[seq.seq_id].blocks)
    assert ra.params is a.sampling_params
    assert (ra.do_sample, ra.prompt_logprobs, ra.beam_width, ra.need_logprob, ra.pooling) == (
        True, True, 0, True, None)
    assert ra.samples == [SampleSpec(seq.seq_id, 0, seq.token_ids, 5)]
    # A forking group's one row draws a token for each of its sequences.
    assert (rb.request_id, rb.do_sample, rb.prompt_logprobs, rb.need_logprob) == (
        "b", True, False, False)
    assert [(s.seq_id, s.index) for s in rb.samples] == [(q.seq_id, q.index) for q in b.seqs]


def test_rows_of_a_decode_step_sample_once_and_share_the_token_lists():
    sched = make(num_blocks=16, block_size=4)
    a = group("a", 5)
    sched.add(a)
    run_step(sched)
    out = sched.schedule()
    (row,) = StepInput.from_schedule(out).rows
    seq = a.seqs[0]
    assert (row.start, row.end, row.do_sample, row.prompt_logprobs) == (5, 6, True, False)
    assert row.token_ids is seq.token_ids  # no copy (see the module docstring)
    assert [(s.seq_id, s.token_ids is seq.token_ids) for s in row.samples] == [
        (seq.seq_id, True)]
