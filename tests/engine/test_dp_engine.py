"""The front end and engine cores apart (vLLM v1's layout), with data parallelism: two real core
processes of a tiny float32 model behind one front end, shared by every test here (the last one
kills a core).

- outputs through the split (tokens, logprobs, text, stop strings, n / best_of, prompt
  logprobs, beams) equal the in-process engine's exactly;
- a multi-turn chat trace: prefix routing keeps the single engine's prefix-cache hit rate and
  beats round-robin;
- the cores publish vLLM's KV events on zmq;
- the OpenAI server over the cores: per-engine metrics; a core killed mid-run: every request
  completes or fails naming the lost engine, none hangs, /health reports it, the other core
  serves on and leaks no block.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.bench.chat_trace import chat_trace, run_chat_trace
from pagedserve.core.beam_search import BeamSearchParams
from pagedserve.engine.mp_engine import MPLLMEngine
from pagedserve.config import EngineArgs

OPTIONS = dict(dtype="float32", block_size=4, num_kv_blocks=512, max_num_seqs=16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def events_port():
    return _free_port()


@pytest.fixture(scope="module")
def front(checkpoints, events_port):
    args = EngineArgs(model=str(checkpoints("llama")), data_parallel_size=2, **OPTIONS,
                      kv_events_config={"enable_kv_cache_events": True,
                                        "endpoint": f"tcp://*:{events_port}",
                                        "topic": "kv"})
    engine = MPLLMEngine(args)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def local(checkpoints):
    # one compute thread, as each core has here (two threads on a loaded 2-CPU machine spin)
    return LLM(str(checkpoints("llama")), cpu_threads=1, **OPTIONS)


def _llm_over(engine) -> LLM:
    llm = LLM.__new__(LLM)
    llm.engine = engine
    llm._finished_counts = {}
    return llm


def _fields(c):
    return (c.token_ids, c.text, c.logprobs, c.cumulative_logprob, c.finish_reason,
            c.stop_reason)


def test_outputs_through_the_split_equal_the_in_process_engine(front, local):
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(n - 1)]}
               for n in (4, 11, 19, 30)] + ["The quick brown fox jumps", "Once upon a time",
                                            "Is it?", "Tell me about the"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, seed=3, max_tokens=10, n=2, logprobs=2, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, stop=["e"], logprobs=1, min_tokens=2),
        SamplingParams(temperature=1.0, seed=7, best_of=3, n=2, max_tokens=8),
        SamplingParams(temperature=0.0, max_tokens=24, stop=[" the", "a"],
                       include_stop_str_in_output=True),
        SamplingParams(temperature=0.7, seed=11, max_tokens=16, n=3, stop=["o"], logprobs=1),
        # the grammar runs in the core, bad words are resolved to ids by the front end
        SamplingParams(temperature=0.0, max_tokens=20,
                       structured_outputs={"choice": ["yes", "no", "maybe"]}),
        SamplingParams(temperature=0.0, max_tokens=12, bad_words=["the"], min_tokens=4,
                       stop_token_ids=[2, 5], logprobs=1),
    ]
    ours = _llm_over(front).generate(prompts, params, use_tqdm=False)
    refs = local.generate(prompts, params, use_tqdm=False)
    stopped = 0
    for a, b in zip(ours, refs):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.prompt_logprobs == b.prompt_logprobs
        assert [_fields(c) for c in a.outputs] == [_fields(c) for c in b.outputs]
        stopped += sum(isinstance(c.stop_reason, str) for c in a.outputs)
    assert stopped >= 2  # stop strings matched in the front end, mid-stream
    beams = BeamSearchParams(beam_width=2, max_tokens=6)
    ours = _llm_over(front).beam_search([prompts[0]], beams)
    refs = local.beam_search([prompts[0]], beams)
    assert [(s.tokens, s.cum_logprob) for s in ours[0].sequences] == \
        [(s.tokens, s.cum_logprob) for s in refs[0].sequences]


def test_a_refused_request_is_a_value_error_naming_it(front):
    llm = _llm_over(front)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(logprobs=50),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 99999]}], SamplingParams(), use_tqdm=False)
    assert not front.has_unfinished_requests()


def test_prefix_routing_keeps_the_single_engines_hit_rate(front, local):
    trace = chat_trace(conversations=10, turns=3, system_prompts=2, system_len=4,
                       user_len=(16, 32), reply_tokens=4, seed=1)
    # concurrency 1: every routing decision sees every event before it (the rates are exact)
    rates = {"single": run_chat_trace(local.engine, trace, concurrency=1).hit_rate}
    for policy in ("prefix", "round-robin"):
        routed = list(front.router.routed)
        front.client.call_all("reset_prefix_cache")
        front.router.policy = policy
        front.router.index.clear(0)
        front.router.index.clear(1)
        result = run_chat_trace(front, trace, concurrency=1)
        assert result.completed == trace.num_requests and not result.failed
        rates[policy] = result.hit_rate
        # both cores took conversations (one core would trivially keep the single engine's rate)
        assert all(n > a + trace.num_requests // 4 for n, a in zip(front.router.routed, routed))
    front.router.policy = "prefix"
    print("hit rates", rates)
    assert rates["prefix"] >= 0.9 * rates["single"], rates
    assert rates["prefix"] >= 1.5 * rates["round-robin"], rates


def test_cores_publish_vllms_kv_events_on_zmq(front, events_port):
    import zmq

    from pagedserve.engine.kv_events import BlockStored, decode_batch

    ctx = zmq.Context.instance()
    subs = []
    for rank in (0, 1):
        sub = ctx.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{events_port + rank}")
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
        subs.append(sub)
    try:
        seen = {}
        for attempt in range(20):  # PUB drops what is sent before a subscriber joins: retry
            # new prompts each time: cached ones store no new block
            prompts = [{"prompt_token_ids": [1, 2 + attempt] + [k * 100 + i for i in range(3, 20)]}
                       for k in range(4)]
            _llm_over(front).generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
            for sub in subs:
                while sub.poll(200):
                    topic, seq, payload = sub.recv_multipart()
                    batch = decode_batch(payload)
                    assert topic == b"kv" and len(seq) == 8
                    if any(isinstance(e, BlockStored) for e in batch.events):
                        seen[batch.data_parallel_rank] = batch
            if len(seen) == 2:
                break
        assert set(seen) == {0, 1}
    finally:
        for sub in subs:
            sub.close(linger=0)


# --- the server over the cores ------------------------------------------------------------------


def _serve(front, main):
    from pagedserve.engine.async_mp_engine import AsyncMPEngine
    from pagedserve.entrypoints.openai.api_server import build_app

    engine = AsyncMPEngine(front, owns_front=False)
    app = build_app(engine, argparse.Namespace(enable_debug_endpoints=True))

    async def run():
        engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                         timeout=60) as client:
                return await main(client, engine)
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def test_the_server_labels_metrics_by_engine(front):
    async def main(client, engine):
        resp = await client.post("/v1/completions", json={
            "model": front.source.name, "prompt": [1, 5, 9, 13], "max_tokens": 4,
            "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"][0]["text"]) > 0
        text = (await client.get("/metrics")).text
        assert 'engine="0"' in text and 'engine="1"' in text
        assert (await client.get("/health")).status_code == 200

    _serve(front, main)


def test_a_killed_core_fails_only_its_running_requests(front):
    async def main(client, engine):
        name = front.source.name
        rng = random.Random(3)

        async def one(i):
            body = {"model": name, "prompt": [1] + [rng.randrange(3, 500) for _ in range(6)],
                    "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                text = "".join([line async for line in resp.aiter_lines()])
            return resp.status_code, text

        tasks = [asyncio.ensure_future(one(i)) for i in range(8)]
        while not (front.in_flight and all(f.request is None for f in front.in_flight.values())
                   and {f.core for f in front.in_flight.values()} == {0, 1}):
            await asyncio.sleep(0.01)  # both cores are running requests
        front.client.kill(1)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)  # nothing hangs
        lost = [t for _, t in results if "engine core 1 died" in t]
        done = [t for _, t in results if "[DONE]" in t and "error" not in t]
        assert lost and done and len(lost) + len(done) == len(results)
        health = await client.get("/health")
        assert health.status_code == 200
        assert health.json()["lost_engines"][0]["engine"] == 1
        # the other core serves on, and new requests go to it
        resp = await client.post("/v1/completions", json={
            "model": name, "prompt": [1, 2, 3], "max_tokens": 3})
        assert resp.status_code == 200
        state = (await client.get("/debug/engine")).json()
        assert state["used_blocks"] == 0 and state["groups"] == 0  # no block leaked

    _serve(front, main)
    assert front.client.alive == [True, False]
