"""Tensor parallelism over worker processes (mp backend, gloo on CPU): two ranks give TP=1's greedy
tokens (float32, tie rule) for a Llama-family, a Gemma 3 and an OPT model, also under preemption;
a worker that dies fails the engine at once, never hangs."""

import operator
import os
import random
import signal
import threading

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.worker.executor import WorkerDiedError
from utils import assert_tie_rule, ours_as_pairs

OPTIONS = dict(dtype="float32", block_size=4, kv_cache_memory=1 << 22)


def prompts_of_lengths(lengths, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n - 1)]}
            for n in lengths]


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)


def completions(llm, prompts, params):
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tp2(checkpoints):
    """One TP=2 engine per architecture for the module; shut down at its end."""
    engines = {}

    def get(arch):
        if arch not in engines:
            engines[arch] = LLM(str(checkpoints(arch)), tensor_parallel_size=2, **OPTIONS)
        return engines[arch]

    yield get
    for llm in engines.values():
        llm.engine.shutdown()


def assert_same_greedy(outs, refs, what):
    for ours, ref in zip(outs, refs):
        assert_tie_rule(ours_as_pairs(ours), ours_as_pairs(ref), what)
        for pos, (tok, ref_pos) in zip(ours.logprobs, zip(ref.token_ids, ref.logprobs)):
            if tok not in pos:
                break
            assert abs(pos[tok].logprob - ref_pos[tok].logprob) < 1e-3


# cohere: per-head q/k norms split; qwen3_next: each rank's half of a recurrent state
@pytest.mark.parametrize("arch", ["llama", "gemma3", "opt", "cohere", "qwen3_next"])
def test_two_worker_processes_give_the_single_process_greedy_tokens(arch, tp2, checkpoints):
    prompts = prompts_of_lengths([3, 9, 17, 30], seed=1)
    single = LLM(str(checkpoints(arch)), **OPTIONS)
    refs = completions(single, prompts, greedy(16))
    llm = tp2(arch)
    assert llm.engine.model is None and llm.engine.kv_cache is None  # all in the workers
    # Each worker caches its own KV heads only, so the same per-worker budget holds twice the
    # blocks -- unless the KV heads are replicated (Gemma's one KV head).
    ratio = {"llama": 2, "gemma3": 1, "opt": 2, "cohere": 2, "qwen3_next": 2}[arch]
    assert llm.engine.num_kv_blocks + 1 == ratio * (single.engine.num_kv_blocks + 1)
    assert_same_greedy(completions(llm, prompts, greedy(16)), refs, arch)
    assert llm.engine.num_used_blocks() == 0


def test_two_worker_processes_under_swap_and_recompute_preemption(tp2, checkpoints):
    path = str(checkpoints("gemma3"))
    prompts = prompts_of_lengths([6, 11, 3, 14, 9, 5, 12, 8, 17, 4], seed=3)
    refs = completions(LLM(path, **OPTIONS), prompts, greedy(24))
    llm = tp2("gemma3")
    # (the tiny Gemma 3 mixes sliding-window and full layers: a pool block holds one layer of
    # the four, so 64 blocks are the bytes 16 blocks of all four layers were)
    llm.engine.reconfigure_cache(num_kv_blocks=64, num_cpu_blocks=20, preemption_mode="auto",
                                 max_num_batched_tokens=32)
    try:
        assert_same_greedy(completions(llm, prompts, greedy(24)), refs, "preempted")
        sched = llm.engine.scheduler
        assert sched.preemptions_by_mode["swap"] > 0 and sched.preemptions_by_mode["recompute"] > 0
        assert llm.engine.kv_manager.pool.num_used == 0
    finally:
        llm.engine.reconfigure_cache(num_kv_blocks=None, num_cpu_blocks=None,
                                     max_num_batched_tokens=None)


# NOTE: the two tests below kill a worker of the module's engines: they come last.


@pytest.mark.timeout(60)
def test_sleep_wake_up_and_collective_rpc_reach_every_worker_process(tp2):
    # NOTE: before the tests below, which kill workers of the module's engines.
    llm = tp2("llama")
    prompts = prompts_of_lengths([5, 12], seed=4)
    refs = completions(llm, prompts, greedy(8))
    infos = llm.collective_rpc("info")
    assert len(infos) == 2 and infos[0].num_params == infos[1].num_params
    llm.sleep()
    # A picklable callable goes to the workers as `method(worker)`: their caches are gone.
    assert llm.collective_rpc(operator.attrgetter("kv_cache")) == [None, None]
    llm.wake_up()
    assert [o.token_ids for o in completions(llm, prompts, greedy(8))] == [
        r.token_ids for r in refs]
    assert llm.engine.num_used_blocks() == 0


@pytest.mark.timeout(60)
def test_a_killed_idle_worker_is_noticed_at_once_and_the_next_step_fails(tp2):
    llm = tp2("llama")
    executor = llm.engine.executor
    noticed = threading.Event()
    executor.add_failure_listener(lambda error: noticed.set())
    llm.generate(prompts_of_lengths([5]), greedy(4), use_tqdm=False)
    os.kill(executor.pids[1], signal.SIGKILL)
    assert noticed.wait(10), "the monitor did not notice the dead worker while idle"
    with pytest.raises(WorkerDiedError, match="worker 1 .* died with exit code -9"):
        llm.engine.check_health()
    with pytest.raises(WorkerDiedError):  # at once, not after a hang (the test's timeout)
        llm.generate(prompts_of_lengths([5]), greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # the failed requests were aborted
    for pid in executor.pids:  # the survivor was stopped (and reaped) too
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    llm.engine.shutdown()


@pytest.mark.timeout(60)
def test_a_worker_killed_during_a_step_fails_that_step_instead_of_hanging(tp2):
    llm = tp2("opt")
    executor = llm.engine.executor
    send = executor._send
    steps = []

    def send_then_kill(payload):
        send(payload)
        steps.append(1)
        if len(steps) == 3:  # rank 0 now waits in an all-reduce for rank 1, which is gone
            os.kill(executor.pids[1], signal.SIGKILL)

    executor._send = send_then_kill
    with pytest.raises(WorkerDiedError, match="worker 1"):
        llm.generate(prompts_of_lengths([5, 8]), greedy(8), use_tqdm=False)
    assert len(steps) == 3
    llm.engine.shutdown()

