"""Priority scheduling through the offline API: `LLM.generate(..., priority=[...])` serves lower
values first with unchanged outputs, and fcfs refuses a non-zero priority (ValueError naming
--scheduling-policy). The server's `priority` field: tests/entrypoints/test_server_priority.py."""

import pytest

from pagedserve import LLM, SamplingParams
from test_llm_engine import prompts_of_lengths
from utils import assert_same_outputs


def _llm(path, **kw):
    return LLM(path, dtype="float32", block_size=4, num_kv_blocks=12, max_num_seqs=1, **kw)


def test_generate_serves_lower_priority_values_first_with_unchanged_outputs(checkpoints):
    path = str(checkpoints("llama"))
    prompts = [{"prompt_token_ids": p} for p in prompts_of_lengths([5, 6, 7, 8], seed=9)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    fcfs = _llm(path).generate(prompts, params, use_tqdm=False)
    llm = _llm(path, scheduling_policy="priority")
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[3, 0, 2, -1])
    assert_same_outputs(outs, fcfs)
    # One sequence at a time (max_num_seqs=1): the order they ran in is the order they finished.
    order = sorted(range(4), key=lambda i: outs[i].metrics.finished_time)
    assert order == [3, 1, 2, 0]


def test_fcfs_refuses_a_non_zero_priority_naming_the_option(checkpoints):
    llm = _llm(str(checkpoints("llama")))
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority: got 2 for 1 prompts"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 0])
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False,
                            priority=[0])) == 1
