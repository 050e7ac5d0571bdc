"""The outputs a step returns (`engine/output_builder.py`): their token and logprob lists cost
O(new tokens) per step, not O(output length), and a list a caller holds never changes."""

import pytest

from pagedserve.bench import step_overhead as so
from pagedserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # The bench's engine: the real scheduler, step update, detokenizer and outputs over a fake
    # model (a random token per row at once).
    folder = so.tiny_llama_folder(tmp_path_factory.mktemp("outputs") / "m")
    eng = so.build_engine(str(folder), max_seqs=8, prompt_len=8, steps=40, seed=0)
    yield eng
    eng.shutdown()


class CountingList(list):
    """A sequence's token list that counts the items its slices copy."""

    copied = 0

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if isinstance(index, slice):
            CountingList.copied += len(item)
        return item


def _add(engine, rid, **params):
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, **params)
    group = engine.add_request(rid, None, params, prompt_token_ids=[1] + list(range(3, 10)))
    return group


def test_output_token_lists_cost_the_new_tokens_per_step_not_the_output_length(engine):
    # Regression (issue 25): every step copied each sequence's whole output into its
    # RequestOutput (O(length) per step, O(length^2) over a request's life; the garbage
    # collector then visited every copied item again).
    group = _add(engine, "count")
    seq = group.seqs[0]
    seq.token_ids = CountingList(seq.token_ids)
    copied = []
    while engine.has_unfinished_requests():
        CountingList.copied = 0
        outs = engine.step()
        copied.append(CountingList.copied)
        if outs and outs[0].finished:
            final = outs[0].outputs[0].token_ids
        del outs  # before the next step, as a streaming caller that sent it on
    assert len(final) == 40 and final == seq.token_ids[8:]
    late = copied[20:-1]
    assert len(late) > 10 and max(late) <= 3, copied  # before: 20 .. 40 items a step


def test_outputs_a_caller_keeps_never_change(engine):
    group = _add(engine, "keep", logprobs=2)
    kept = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            kept.append(out)
    seq = group.seqs[0]
    assert len(kept) >= 40
    for out in kept:  # each as it was when returned: a prefix of the final output
        c = out.outputs[0]
        n = len(c.token_ids)
        assert c.token_ids == seq.token_ids[8:8 + n]
        assert c.logprobs == seq.output_logprobs[:n] and len(c.logprobs) == n
    assert [len(o.outputs[0].token_ids) for o in kept[-5:]] == [36, 37, 38, 39, 40]


def test_a_dropped_output_list_the_caller_changed_is_not_reused(engine):
    group = _add(engine, "change")
    engine.step()  # prefill and the first token
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = out.outputs[0].token_ids
            if ids:
                ids.pop()  # changed, then dropped
            if len(ids) > 3:
                ids[-1] = -1  # changed in place, same length
    assert out.finished
    del ids, out
    assert group.seqs[0].handed_tokens.items is not None
    # The engine's own record is right, and so is a fresh output.
    assert engine._make_output(group, True).outputs[0].token_ids == group.seqs[0].token_ids[8:]
