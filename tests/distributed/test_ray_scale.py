"""Scale-out on a local Ray instance (one, shared by the module: Ray starts slowly):

- `--data-parallel-backend ray`: two engine cores as Ray actors (a placement group each) give
  the in-process engine's tokens and logprobs exactly;
- `--pipeline-parallel-size 2`: the layers in two stages (Ray actors), micro-batches in flight,
  give PP=1's tokens and logprobs exactly in float32, also under preemption (swap and
  recompute).

Ray comes with the `[test]` extra, so these never skip."""

import random

import pytest

from pagedserve import LLM, SamplingParams

import ray  # a test dependency: missing fails the test, never skips it


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def _prompts(seed, lengths):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n - 1)]}
            for n in lengths]


def _same(outs, refs):
    for ours, ref in zip(outs, refs):
        assert ours.prompt_logprobs == ref.prompt_logprobs
        assert [(c.token_ids, c.logprobs, c.cumulative_logprob) for c in ours.outputs] == \
            [(c.token_ids, c.logprobs, c.cumulative_logprob) for c in ref.outputs]


@pytest.mark.timeout(300)
def test_two_ray_engine_cores_give_the_in_process_outputs(checkpoints, local_ray):
    path = str(checkpoints("llama"))
    prompts = _prompts(9, (5, 9, 14, 21))
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
    _same(outs, refs)


@pytest.mark.timeout(300)
def test_two_pipeline_stages_give_one_stages_outputs_under_preemption(checkpoints, local_ray):
    path = str(checkpoints("llama"))
    prompts = _prompts(5, (4, 11, 19, 30, 7, 25))
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.8, seed=3, max_tokens=20, n=2, logprobs=2,
                             prompt_logprobs=2)] * 3
    # a cache too small for the batch: requests are preempted (swapped, then recomputed)
    options = dict(dtype="float32", block_size=4, num_kv_blocks=24, num_cpu_blocks=40,
                   max_num_seqs=8, cpu_threads=1)
    one = LLM(path, preemption_mode="swap", **options)
    two = LLM(path, pipeline_parallel_size=2, preemption_mode="swap", **options)
    try:
        assert two.engine.executor.num_stages == 2
        for mode in ("swap", "recompute"):
            for llm in (one, two):
                llm.engine.reconfigure_cache(preemption_mode=mode)
            refs = one.generate(prompts, params, use_tqdm=False)
            outs = two.generate(prompts, params, use_tqdm=False)
            sched = two.engine.scheduler
            assert sched.preemptions_by_mode.get(mode, 0) > 0, sched.preemptions_by_mode
            _same(outs, refs)
        assert two.engine.num_used_blocks() == 0
        # steps were cut into micro-batches (the stages overlap)
        assert two.engine.executor.micro_batches > two.engine.stats["steps"]
    finally:
        two.engine.shutdown()
