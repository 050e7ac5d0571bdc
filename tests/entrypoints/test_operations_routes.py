"""vLLM's operations routes, behind the switches vLLM 0.32 puts them behind (in process, on the
tiny Llama): /inference/v1/abort_requests always; /sleep, /wake_up, /is_sleeping,
/reset_prefix_cache, /collective_rpc, /server_info, /pause, /resume, /is_paused, /abort_requests
with VLLM_SERVER_DEV_MODE=1; /start_profile and /stop_profile with --profiler-config. Aborted
and paused requests leave no block behind. And /v1/responses/{id}/cancel."""

from __future__ import annotations

import asyncio
import json

import pytest
from app_utils import run_app

DEV_ROUTES = [("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping"),
              ("post", "/reset_prefix_cache"), ("post", "/collective_rpc"),
              ("get", "/server_info"), ("post", "/pause"), ("post", "/resume"),
              ("get", "/is_paused"), ("post", "/abort_requests")]
LONG = {"prompt": "Hello there", "max_tokens": 40, "ignore_eos": True, "temperature": 0}


@pytest.fixture
def dev_mode(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")


async def started(llm, min_tokens: int = 2) -> str:
    """The id of the one request in flight once it has generated `min_tokens` tokens."""
    for _ in range(2000):
        groups = list(llm.groups.values())
        if groups and groups[0].seqs[0].num_output_tokens >= min_tokens:
            return groups[0].request_id
        await asyncio.sleep(0.005)
    raise AssertionError("the request never started")


def test_without_dev_mode_only_the_abort_route_is_served(small_engine, monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)

    async def main(client):
        codes = [(await client.request(m.upper(), path)).status_code for m, path in DEV_ROUTES]
        codes += [(await client.post(p)).status_code for p in ("/start_profile",
                                                              "/stop_profile")]
        missing = await client.post("/inference/v1/abort_requests", json={})
        return codes, missing

    codes, missing = run_app(small_engine, main)
    assert set(codes) == {404}
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "request_ids"


def test_abort_by_id_ends_the_request_with_abort_and_frees_its_blocks(small_engine):
    llm = small_engine

    async def main(client):
        task = asyncio.create_task(client.post("/v1/completions", json=LONG))
        rid = await started(llm)
        r = await client.post("/inference/v1/abort_requests",
                              json={"request_ids": [rid, "unknown-id"]})
        answer = (await task).json()
        return r.json(), answer, llm.num_used_blocks()  # (run_app aborts what is left after)

    aborted, answer, blocks = run_app(llm, main)
    assert blocks == 0
    assert aborted["request_ids"] == [aborted_id := aborted["request_ids"][0]]
    assert answer["id"] == aborted_id and answer["choices"][0]["finish_reason"] == "abort"
    assert 0 < answer["usage"]["completion_tokens"] < LONG["max_tokens"]
    assert llm.num_used_blocks() == 0


def test_pause_keep_holds_requests_and_resume_finishes_them(small_engine, dev_mode):
    llm = small_engine

    async def main(client):
        task = asyncio.create_task(client.post("/v1/completions", json=LONG))
        await started(llm)
        assert (await client.post("/pause", params={"mode": "keep"})).json() == {
            "status": "paused"}
        paused = (await client.get("/is_paused")).json()
        held = llm.groups and next(iter(llm.groups.values())).seqs[0].num_output_tokens
        await asyncio.sleep(0.3)
        still = next(iter(llm.groups.values())).seqs[0].num_output_tokens
        assert (await client.post("/resume")).json() == {"status": "resumed"}
        return paused, held, still, (await task).json(), (await client.get("/is_paused")).json()

    paused, held, still, answer, after = run_app(llm, main)
    assert paused == {"is_paused": True} and after == {"is_paused": False}
    assert held == still  # no step while paused
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert llm.num_used_blocks() == 0


def test_pause_aborts_by_default_and_abort_requests_without_ids_ends_all(small_engine, dev_mode):
    llm = small_engine

    async def main(client):
        first = asyncio.create_task(client.post("/v1/completions", json=LONG))
        await started(llm)
        await client.post("/pause")
        first = (await first).json()
        await client.post("/resume")
        second = asyncio.create_task(client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
            "ignore_eos": True}))
        await started(llm)
        everything = (await client.post("/abort_requests", json={})).json()
        second = (await second).json()
        return first, second, everything, llm.num_used_blocks()

    first, second, everything, blocks = run_app(llm, main)
    assert blocks == 0
    assert first["choices"][0]["finish_reason"] == "abort"
    assert second["choices"][0]["finish_reason"] == "abort"
    assert everything["aborted"] == 1
    assert llm.num_used_blocks() == 0


def test_sleep_frees_the_cache_until_wake_up(small_engine, dev_mode):
    llm = small_engine

    async def main(client):
        before = (await client.post("/v1/completions", json={**LONG, "max_tokens": 4})).json()
        out = {"sleep": (await client.post("/sleep")).json(),
               "asleep": (await client.get("/is_sleeping")).json(),
               "refused": (await client.post("/v1/completions", json=LONG)).status_code,
               "bad_level": (await client.post("/sleep", params={"level": 2})).status_code,
               "wake": (await client.post("/wake_up")).json(),
               "awake": (await client.get("/is_sleeping")).json()}
        after = (await client.post("/v1/completions", json={**LONG, "max_tokens": 4})).json()
        metrics = (await client.get("/metrics")).status_code
        return before, out, after, metrics

    before, out, after, metrics = run_app(llm, main)
    assert out["sleep"] == {"status": "sleeping", "level": 1}
    assert out["asleep"] == {"is_sleeping": True} and out["awake"] == {"is_sleeping": False}
    assert out["refused"] == 400
    assert out["wake"]["status"] == "awake"
    assert after["choices"][0]["text"] == before["choices"][0]["text"]  # same greedy text
    assert metrics == 200 and llm.num_used_blocks() == 0


def test_prefix_cache_rpc_and_server_info(small_engine, dev_mode):
    async def main(client):
        return ((await client.post("/reset_prefix_cache")).json(),
                (await client.post("/collective_rpc", json={"method": "info"})).json(),
                (await client.post("/collective_rpc", json={})).status_code,
                (await client.get("/server_info")).json(),
                (await client.get("/server_info", params={"config_format": "json"})).json())

    reset, rpc, no_method, info, info_json = run_app(small_engine, main)
    assert reset == {"success": True}
    assert len(rpc["results"]) == 1 and "num_layers=2" in rpc["results"][0]  # one rank
    assert no_method == 400
    assert set(info) == {"vllm_config", "vllm_env", "system_env"}
    assert isinstance(info["vllm_config"], str)
    assert info_json["vllm_config"]["model"] == small_engine.args.model


def test_profile_routes_with_a_profiler_config(small_engine, tmp_path):
    async def main(client):
        started_ = (await client.post("/start_profile")).status_code
        await client.post("/v1/completions", json={**LONG, "max_tokens": 3})
        stopped = (await client.post("/stop_profile")).status_code
        again = (await client.post("/stop_profile")).status_code
        return started_, stopped, again

    config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    assert run_app(small_engine, main, profiler_config=config) == (200, 200, 400)
    [trace] = list(tmp_path.glob("*.json"))
    assert "traceEvents" in trace.read_text()[:2000]


def test_cancelling_a_response(http_chain):
    made = http_chain.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4}).json()
    r = http_chain.post(f"/v1/responses/{made['id']}/cancel")
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Cannot cancel a synchronous response."
    r = http_chain.post("/v1/responses/resp_unknown/cancel")
    assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"
