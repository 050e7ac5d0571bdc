"""`--data-parallel-backend ray`: two engine cores as Ray actors (a placement group each) on a
local Ray instance give the in-process engine's tokens and logprobs exactly. One short test (Ray
and its actors start slowly); Ray comes with the `[test]` extra, so it never skips."""

import random

import pytest

from pagedserve import LLM, SamplingParams

import ray  # a test dependency: missing fails the test, never skips it


@pytest.mark.timeout(300)
def test_two_ray_engine_cores_give_the_in_process_outputs(checkpoints):
    path = str(checkpoints("llama"))
    rng = random.Random(9)
    prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n - 1)]}
               for n in (5, 9, 14, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    options = dict(dtype="float32", block_size=4, num_kv_blocks=64, cpu_threads=1)
    refs = LLM(path, **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, data_parallel_size=2, data_parallel_backend="ray", **options)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.router.routed[0] and llm.engine.router.routed[1]
        assert all(llm.engine.client.alive)
    finally:
        llm.engine.shutdown()
    assert not ray.is_initialized()  # the front end started the local instance, and stopped it
    for ours, ref in zip(outs, refs):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        assert ours.outputs[0].logprobs == ref.outputs[0].logprobs
