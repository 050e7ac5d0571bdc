"""The seeded trace: reproducible, lengths as asked."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tiny  # noqa: E402
from pagedserve.bench.trace import sharegpt_like_trace  # noqa: E402


def test_trace_is_seeded_and_has_the_requested_mean_lengths():
    tok = tiny.tokenizer()
    a = sharegpt_like_trace(tok, 400, input_len_mean=100, output_len_mean=50, seed=3)
    b = sharegpt_like_trace(tok, 400, input_len_mean=100, output_len_mean=50, seed=3)
    assert a == b
    assert a != sharegpt_like_trace(tok, 400, input_len_mean=100, output_len_mean=50, seed=4)
    mean_in = sum(len(r.prompt_token_ids) for r in a) / len(a)
    mean_out = sum(r.output_len for r in a) / len(a)
    assert 85 < mean_in < 115 and 38 < mean_out < 62
    assert len({len(r.prompt_token_ids) for r in a}) > 50  # lognormal, not constant


def test_fixed_output_length():
    trace = sharegpt_like_trace(tiny.tokenizer(), 5, output_len_fixed=7)
    assert {r.output_len for r in trace} == {7}


def test_the_copy_trace_quotes_a_passage_the_answer_is_asked_to_repeat():
    from pagedserve.bench.trace import copy_trace

    tok = tiny.tokenizer()
    a = copy_trace(tok, 20, input_len_mean=40, seed=1)
    assert a == copy_trace(tok, 20, input_len_mean=40, seed=1)
    for r in a:
        text = tok.decode(r.prompt_token_ids)
        assert "exactly as it is" in text
        # the output is the passage's length plus a few tokens; the prompt holds the passage
        assert len(r.prompt_token_ids) > r.output_len - 8
