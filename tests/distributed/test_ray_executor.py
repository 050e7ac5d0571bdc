"""The Ray backend on a local Ray instance: two actors give TP=1's greedy tokens. One short test
(Ray and its actors start slowly); Ray comes with the `[test]` extra, so it never skips."""

import random

import pytest

from pagedserve import LLM, SamplingParams
from utils import assert_tie_rule, ours_as_pairs

import ray  # a test dependency: missing fails the test, never skips it


@pytest.mark.timeout(300)
def test_two_ray_actors_give_the_single_process_greedy_tokens(checkpoints):
    path = str(checkpoints("llama"))
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n - 1)]}
               for n in (4, 11, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    options = dict(dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    refs = LLM(path, **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **options)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.check_health()
    finally:
        llm.engine.shutdown()
    assert not ray.is_initialized()  # the executor started the local instance, and stopped it
    for ours, ref in zip(outs, refs):
        assert_tie_rule(ours_as_pairs(ours.outputs[0]), ours_as_pairs(ref.outputs[0]), "ray")
