"""AsyncLLMEngine in process on a tiny Llama: batching across concurrent callers, abort on
cancel within one step, validation errors, queue limit, crash and shutdown."""

import asyncio
import threading

import pytest

from pagedserve import LLMEngine, SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineShutdownError,
    QueueFullError,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def llm_engine(checkpoints):
    return LLMEngine(EngineArgs(model=str(checkpoints("llama")), dtype="float32",
                                num_kv_blocks=256, block_size=4, max_model_len=256))


def greedy(n_tokens):
    return SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True)


class Recorder:
    """A stats listener keeping every step record (called in the engine thread)."""

    def __init__(self):
        self.steps = []
        self.finished = []

    def on_step(self, stats):
        self.steps.append(stats)

    def on_request_finished(self, stats):
        self.finished.append(stats)


async def collect(engine, prompt_ids, params, request_id=None):
    last = None
    async for out in engine.generate(None, params, request_id, prompt_token_ids=prompt_ids):
        last = out
    return last


def test_16_concurrent_requests_take_at_most_twice_the_steps_of_one(llm_engine):
    prompts = [[1] + [10 + i + j for j in range(6)] for i in range(16)]

    async def main():
        async with AsyncLLMEngine(llm_engine) as engine:
            before = llm_engine.stats["steps"]
            alone = await collect(engine, prompts[0], greedy(16))
            one = llm_engine.stats["steps"] - before
            before = llm_engine.stats["steps"]
            outs = await asyncio.gather(*(collect(engine, p, greedy(16)) for p in prompts))
            many = llm_engine.stats["steps"] - before
        return alone, one, outs, many

    alone, one, outs, many = asyncio.run(main())
    assert one == 16
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    assert many <= 2 * one, f"16 concurrent requests took {many} steps, one took {one}"
    # Batched greedy equals alone.
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids


def test_cancelled_generate_is_aborted_within_one_step_and_frees_its_blocks(llm_engine):
    recorder = Recorder()

    async def main():
        engine = AsyncLLMEngine(llm_engine, listeners=[recorder])
        async with engine:
            first = asyncio.Event()

            async def consume():
                async for _ in engine.generate(None, greedy(200), "victim",
                                               prompt_token_ids=[1, 5, 6, 7]):
                    first.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), 10)
            assert recorder.steps[-1].num_used_blocks > 0
            steps_at_cancel = len(recorder.steps)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if recorder.finished:
                    break
                await asyncio.sleep(0.01)
            # The record published right after the abort (a step may have been in progress).
            freed_at = next(i for i, s in enumerate(recorder.steps) if i >= steps_at_cancel
                            and s.num_used_blocks == 0)
        return steps_at_cancel, freed_at

    steps_at_cancel, freed_at = asyncio.run(main())
    assert [f.finish_reason for f in recorder.finished] == ["abort"]
    # At most the step already running when the abort arrived, then the abort's own record.
    assert freed_at - steps_at_cancel <= 1
    assert llm_engine.num_used_blocks() == 0


def test_invalid_request_raises_value_error_and_the_engine_keeps_serving(llm_engine):
    async def main():
        async with AsyncLLMEngine(llm_engine) as engine:
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await engine.add_request("bad", None, greedy(4), prompt_token_ids=[1, 10**6])
            with pytest.raises(ValueError, match="max_logprobs"):
                await collect(engine, [1, 2, 3], SamplingParams(max_tokens=2, logprobs=1000))
            return await collect(engine, [1, 5, 6], greedy(3))

    out = asyncio.run(main())
    assert out.finished and len(out.outputs[0].token_ids) == 3


def test_requests_past_max_queued_requests_raise_queue_full(llm_engine):
    gate = threading.Event()
    real_step = llm_engine.step

    def gated_step():
        gate.wait(10)
        return real_step()

    async def main():
        engine = AsyncLLMEngine(llm_engine, max_queued_requests=1)
        llm_engine.step = gated_step  # the first step blocks: request A stays queued
        try:
            async with engine:
                a = await engine.add_request("a", None, greedy(2), prompt_token_ids=[1, 5])
                assert engine.num_queued == 1
                with pytest.raises(QueueFullError):
                    await engine.add_request("b", None, greedy(2), prompt_token_ids=[1, 6])
                gate.set()
                outs = [o async for o in a]
                return outs[-1]
        finally:
            gate.set()
            del llm_engine.step

    last = asyncio.run(main())
    assert last.finished


def test_engine_crash_fails_requests_in_flight_and_refuses_new_ones(llm_engine):
    # A step that keeps failing before scheduling anything: no request to blame, so the
    # engine retries once, then dies (a failure pinned on requests only fails those: see
    # tests/entrypoints/test_engine_failure.py).
    real_step = llm_engine.step
    calls = []

    def failing_step():
        calls.append(1)
        if len(calls) >= 3:
            raise RuntimeError("boom")
        return real_step()

    async def main():
        engine = AsyncLLMEngine(llm_engine)
        llm_engine.step = failing_step
        try:
            async with engine:
                with pytest.raises(EngineDeadError, match="boom"):
                    await collect(engine, [1, 5, 6], greedy(50))
                assert engine.errored and not engine.accepting
                with pytest.raises(EngineDeadError):
                    await engine.add_request("x", None, greedy(2), prompt_token_ids=[1, 5])
        finally:
            del llm_engine.step
            for request_id in list(llm_engine.groups):
                llm_engine.abort_request(request_id)

    asyncio.run(main())
    assert len(calls) == 4


def test_one_failure_before_scheduling_is_retried_and_the_request_still_completes(llm_engine):
    real_step = llm_engine.step
    calls = []

    def flaky_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("transient")
        return real_step()

    async def main():
        engine = AsyncLLMEngine(llm_engine)
        llm_engine.step = flaky_step
        try:
            async with engine:
                out = await collect(engine, [1, 5, 6], greedy(8))
                assert not engine.errored
                return out
        finally:
            del llm_engine.step
            for request_id in list(llm_engine.groups):
                llm_engine.abort_request(request_id)

    out = asyncio.run(main())
    assert out.finished and len(out.outputs[0].token_ids) == 8
    assert len(calls) > 3


def test_shutdown_ends_requests_in_flight_with_engine_shutdown_error(llm_engine):
    async def main():
        engine = AsyncLLMEngine(llm_engine)
        engine.start()
        stream = await engine.add_request("s", None, greedy(200), prompt_token_ids=[1, 5, 6])
        await stream.__anext__()
        await engine.shutdown()
        with pytest.raises(EngineShutdownError):
            async for _ in stream:
                pass
        with pytest.raises(EngineShutdownError):
            await engine.add_request("t", None, greedy(2), prompt_token_ids=[1, 5])

    asyncio.run(main())
    assert llm_engine.num_used_blocks() == 0 and not llm_engine.has_unfinished_requests()
