"""pagedserve on Ray Serve (`entrypoints/ray_serve`): the app on a local Ray with a tiny random
model and two engine replicas, through its HTTP ingress:

- requests sharing a long prefix land on the replica that cached it (each replica's own
  prefix-cache counters, as reported to the cache index), an unrelated one on the other;
- a completion equals the in-process `LLM`'s greedy tokens; chat completions and streaming
  answer; a bad parameter is a 400 naming it, whether the ingress or the replica's engine
  refuses it.

Skips when `ray.serve` is not importable (`pip install 'pagedserve[serve]'`). Serve starts
slowly (a Ray instance, its controller and proxy, three replicas): one test, marked slow."""

import json
import socket
import time

import pytest

serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from pagedserve import LLM, SamplingParams  # noqa: E402

OPTIONS = dict(dtype="float32", block_size=4, num_kv_blocks=64, cpu_threads=1)
PREFIX = [1] + [(7 * i) % 480 + 3 for i in range(31)]  # 8 full blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settled(client, deadline_s=20.0) -> dict:
    """The index's per-replica counters once every replica reported its requests' end."""
    end = time.monotonic() + deadline_s
    while True:
        stats = client.get("/v1/cache_index").json()["replicas"]
        if all(r["load"] == 0 for r in stats.values()) or time.monotonic() > end:
            return stats
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_app_routes_a_shared_prefix_to_its_replica_and_matches_llm(checkpoints):
    import ray

    from pagedserve.entrypoints.ray_serve import build_app

    path = str(checkpoints("llama"))
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(path, engine_kwargs=OPTIONS, num_replicas=2, routing="prefix",
                            name="t-serve"), name="t-serve", route_prefix="/")
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)

        def complete(ids, max_tokens=4):
            r = client.post("/v1/completions", json={
                "model": path, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        # the same greedy tokens as the in-process engine
        first = PREFIX + [11, 12, 13]
        got = complete(first, max_tokens=8)
        ref = LLM(path, **OPTIONS).generate(
            {"prompt_token_ids": first},
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert got == list(ref[0].outputs[0].token_ids)
        # three more turns on the same prefix, then an unrelated prompt
        for tail in ([21, 22], [31, 32, 33, 34], [41]):
            complete(PREFIX + tail)
        complete([1] + [(5 * i) % 470 + 9 for i in range(20)])
        stats = _settled(client)
        assert len(stats) == 2
        holder, other = sorted(stats.values(), key=lambda r: -r["prefix_hits"])
        # every later turn found the prefix's 8 blocks (32 tokens) cached where it was
        assert holder["routed"] == 4 and holder["prefix_hits"] >= 3 * len(PREFIX), stats
        assert other["routed"] == 1 and other["prefix_hits"] == 0, stats

        r = client.post("/v1/chat/completions", json={
            "model": path, "messages": [{"role": "user", "content": "hi there"}],
            "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        # NOTE: a stream may carry the 3 tokens in fewer chunks (a slow reader gets the newest
        # output, which holds everything since its last read), so pin the text, not the count
        body = {"model": path, "prompt": "a b c", "max_tokens": 3, "temperature": 0}
        whole = client.post("/v1/completions", json=body).json()["choices"][0]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 2, lines
        chunks = [json.loads(line[len("data: "):])["choices"][0] for line in lines[:-1]]
        assert "".join(c["text"] for c in chunks) == whole["text"], (chunks, whole)
        assert chunks[-1]["finish_reason"] == whole["finish_reason"] == "length", chunks
        r = client.post("/v1/completions", json={"model": path, "prompt": "x",
                                                  "max_tokens": 2, "temperature": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
        # the replica's engine refuses it (its scheduling policy): the same 400
        r = client.post("/v1/completions", json={"model": path, "prompt": "x",
                                                  "max_tokens": 2, "priority": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    finally:
        serve.shutdown()
        ray.shutdown()


def test_serve_flags_make_the_app_and_refuse_what_does_not_apply():
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.entrypoints.ray_serve import build_app
    from pagedserve.entrypoints.ray_serve.run import app_from_args, engine_kwargs_from_args

    def parse(*flags):
        args = build_parser().parse_args(["serve", "some/model", "--ray-serve", *flags])
        args.model = args.model_tag
        return args

    args = parse("--dtype", "float32", "--block-size", "4", "--ray-serve-autoscaling",
                 '{"min_replicas": 1, "max_replicas": 3}', "--data-parallel-routing",
                 "least-load")
    assert engine_kwargs_from_args(args) == {"dtype": "float32", "block_size": 4}
    assert type(app_from_args(args)).__name__ == "Application"
    for flags, message in ((["--ray-serve-autoscaling", "[1]"], "--ray-serve-autoscaling"),
                           (["--data-parallel-size", "2"], "--ray-serve-replicas"),
                           (["--ray-serve-cpus-per-replica", "0"], "cpus-per-replica")):
        with pytest.raises(ValueError, match=message):
            app_from_args(parse(*flags))
    with pytest.raises(ValueError, match="not both"):
        build_app("some/model", num_replicas=2, autoscaling_config={"max_replicas": 2})
    with pytest.raises(ValueError, match="routing"):
        build_app("some/model", routing="random")
