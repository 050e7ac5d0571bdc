"""Priority scheduling through the engine's APIs: `LLM.generate(..., priority=[...])`, the
server's `priority` field, and the refusal of a non-zero priority under fcfs (ValueError / 400
naming --scheduling-policy)."""

import argparse
import asyncio

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.entrypoints.openai.api_server import build_app
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


@pytest.mark.timeout(120)
def test_server_takes_priority_under_the_priority_policy_and_400s_it_under_fcfs(checkpoints):
    path = str(checkpoints("llama"))

    def post(llm, bodies):
        engine = AsyncLLMEngine(llm.engine)
        app = build_app(engine, argparse.Namespace())

        async def main():
            engine.start()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://test", timeout=60) as c:
                out = [await c.post(url, json=body) for url, body in bodies]
            await engine.shutdown()
            return out

        return asyncio.run(main())

    body = {"prompt": [1, 5, 9], "max_tokens": 2, "priority": 3}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": -1}
    bad, bad_chat, ok = post(_llm(path), [("/v1/completions", body),
                                          ("/v1/chat/completions", chat),
                                          ("/v1/completions", {**body, "priority": 0})])
    for resp in (bad, bad_chat):
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert "--scheduling-policy" in err["message"] and err["param"] == "priority"
    assert ok.status_code == 200
    good, good_chat = post(_llm(path, scheduling_policy="priority"),
                           [("/v1/completions", body), ("/v1/chat/completions", chat)])
    assert good.status_code == 200 and good_chat.status_code == 200
