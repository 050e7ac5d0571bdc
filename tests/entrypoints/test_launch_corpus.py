"""A vLLM user's launch command works unchanged: 20 commands shaped like those of vLLM's docs and
recipes go through `pagedserve serve`'s own path (flags parsed, vLLM's flags checked, the engine
built from them), then the app answers a chat -- in process (the server's `run_server` replaced
by the app on an ASGI transport, no socket). Tiny random Llama (the answers are noise; what is
checked is that the command starts and serves, and what its flags change), and the default
model's first chat: "What is the capital of France?"."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex

import httpx
import pytest

from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.entrypoints import cli
from pagedserve.entrypoints.openai import api_server

CHAT = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4, "temperature": 0}

# (command after `pagedserve`, request headers, what to check in the answer)
CORPUS = [
    "serve {tiny}",
    "serve --model {tiny} --dtype float --max-model-len 256",
    "serve {tiny} --dtype bfloat16 --max-model-len 512 --kv-cache-memory-bytes 8M",
    "serve {tiny} --trust-remote-code --served-model-name my-model other --api-key k1 k2",
    "serve {tiny} --tensor-parallel-size 1 --max-num-seqs 8 --max-num-batched-tokens 256 "
    "--enable-chunked-prefill --long-prefill-token-threshold 32",
    "serve {tiny} --enable-prefix-caching --block-size 16 --gpu-memory-utilization 0.9 "
    "--disable-log-stats --seed 0",
    "serve {tiny} --enable-auto-tool-choice --tool-call-parser hermes",
    "serve {tiny} --chat-template {template} --response-role bot",
    "serve {tiny} --config {config}",
    "serve {tiny} --revision main --tokenizer-mode auto --hf-overrides '{{\"rope_theta\": 20000}}'",
    "serve {tiny} --enable-log-requests --max-log-len 20 --enable-log-outputs",
    "serve {tiny} --host 0.0.0.0 --port 8080 --uvicorn-log-level warning "
    "--disable-uvicorn-access-log --disable-fastapi-docs",
    "serve {tiny} --limit-mm-per-prompt '{{\"image\": 0}}' --enforce-eager",
    "serve {tiny} --async-scheduling --stream-interval 3",
    "serve {tiny} --default-chat-template-kwargs '{{\"enable_thinking\": false}}' "
    "--chat-template-content-format string",
    "serve {tiny} --generation-config vllm --max-logprobs 5 --num-gpu-blocks-override 32",
    "serve {tiny} --speculative-config '{{\"method\": \"ngram\", \"num_speculative_tokens\": 2, "
    "\"prompt_lookup_max\": 2}}'",
    "serve {tiny} -tp 1 --distributed-executor-backend uni --kv-cache-dtype fp8 "
    "--compilation-config '{{\"level\": 3}}' --swap-space 1",
    "serve {tiny} --allowed-origins '[\"https://app.example\"]' --allow-credentials",
    "serve {tiny} --structured-outputs-config '{{\"disable_any_whitespace\": true}}' "
    "--uds /tmp/pagedserve-test.sock --ssl-cert-reqs 0",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("launch")
    template = folder / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}bot: {% endif %}")
    config = folder / "serve.yaml"
    config.write_text("max-model-len: 256\nmax-num-seqs: 4\nenable-prefix-caching: false\n"
                      "served-model-name: from-yaml\n")
    return {"template": str(template), "config": str(config)}


def serve(argv: list[str], check, monkeypatch) -> None:
    """`pagedserve serve ...` through cli.main, its server replaced by `check(args, client)`
    on the app in process."""
    ran = []

    def run_in_process(args: argparse.Namespace) -> int:
        from pagedserve.config import EngineArgs
        from pagedserve.engine.llm_engine import LLMEngine

        # NOTE: a small CPU swap pool (as the command's KV budget, VLLM_CPU_KVCACHE_SPACE, is
        # small): the default 4 GiB of a tiny model's blocks takes a second to list
        engine = AsyncLLMEngine(LLMEngine(EngineArgs.from_namespace(args, swap_space=1 / 64)))
        app = api_server.build_app(engine, args)

        async def main():
            engine.start()
            try:
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                             timeout=120) as client:
                    await check(args, client)
            finally:
                await engine.shutdown()

        asyncio.run(main())
        ran.append(args)
        return 0

    monkeypatch.setattr(api_server, "run_server", run_in_process)
    assert cli.main(argv) == 0
    assert ran, argv


@pytest.mark.parametrize("index", range(len(CORPUS)), ids=lambda i: CORPUS[i].split(" ", 2)[-1][:40])
def test_launch_command_starts_and_answers_a_chat(index, tiny_llama, files, monkeypatch, caplog):
    # vLLM's CPU backend's KV budget, as its docs set it: 16 MiB here (tiny model)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(16 / 1024))
    command = CORPUS[index].format(tiny=tiny_llama, **files)
    argv = shlex.split(command)

    async def check(args, client):
        headers = {"Authorization": "Bearer k2"} if args.api_key else {}
        if "--allowed-origins" in command or index == 0:
            headers["Origin"] = "https://app.example"
        model = {3: "other", 8: "from-yaml"}.get(index)
        body = {**CHAT, **({"model": model} if model else {})}
        if index == 13:  # --stream-interval 3: chunks of 3 tokens (the last may be shorter)
            resp = await client.post("/v1/chat/completions", json={**body, "max_tokens": 7,
                                                                   "stream": True,
                                                                   "ignore_eos": True})
            chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
                      if line.startswith("data: {")]
            texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
            assert len([t for t in texts if t]) <= 3, texts  # 7 tokens: 3 + 3 + 1 at most
            return
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status_code == 200, (command, resp.text)
        message = resp.json()["choices"][0]["message"]
        assert message["role"] == ("bot" if "--response-role" in command else "assistant")
        if index == 0:  # vLLM 0.32's CORS default: no origin allowed
            assert "access-control-allow-origin" not in resp.headers
        if "--allowed-origins" in command:
            assert resp.headers["access-control-allow-origin"] == "https://app.example"
        if "--api-key" in command:
            assert (await client.get("/v1/models")).status_code == 401
            ok = await client.get("/v1/models", headers={"Authorization": "Bearer k1"})
            assert [m["id"] for m in ok.json()["data"]] == ["my-model", "other"]
        if "--disable-fastapi-docs" in command:
            assert (await client.get("/openapi.json")).status_code == 404
        if "--config" in command:
            assert (args.max_model_len, args.max_num_seqs, args.enable_prefix_caching) == \
                (256, 4, False)

    with caplog.at_level(logging.INFO, logger="pagedserve"):  # (bench paper quiets it)
        serve(argv, check, monkeypatch)
    text = caplog.text
    assert "engine ready" in text
    if "--trust-remote-code" in command:
        assert "never runs code from a model's files" in text
    if "--limit-mm-per-prompt" in command:
        assert "--limit-mm-per-prompt has no effect here: the models served here are text-only" in text
    if "--kv-cache-dtype fp8" in command:  # fp8 KV blocks (vLLM's fp8 = e4m3), in the log
        assert "kv_cache_dtype=fp8 (float8_e4m3fn, " in text
    if "--compilation-config" in command:
        assert "--compilation-config has no effect here" in text
    if "--enable-log-requests" in command:
        assert "Received request" in text and "Generated response" in text
    if "--kv-cache-memory-bytes" not in command and "--num-gpu-blocks" not in command:
        assert "0.02 GiB" in text  # VLLM_CPU_KVCACHE_SPACE=16 MiB


def test_openapi_has_no_duplicate_operation_ids(tiny_llama, monkeypatch, recwarn):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(16 / 1024))

    async def check(args, client):
        spec = (await client.get("/openapi.json")).json()
        ids = [op["operationId"] for path in spec["paths"].values() for op in path.values()]
        assert len(ids) == len(set(ids))

    serve(["serve", str(tiny_llama)], check, monkeypatch)
    assert not [w for w in recwarn if "Duplicate Operation ID" in str(w.message)]


def test_run_batch_answers_openai_batch_lines_in_order(tiny_llama, tmp_path, capsys):
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Hi", "max_tokens": 3}},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {**CHAT, "max_tokens": 0}},
        {"custom_id": "d", "method": "GET", "url": "/v1/models", "body": {}},
    ]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert cli.main(["run-batch", "-i", str(src), "-o", str(dst), "--model", str(tiny_llama),
                     "--dtype", "float32", "--num-kv-blocks", "32"]) == 0
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["a", "b", "c", "d"]
    assert out[0]["response"]["status_code"] == 200
    assert out[0]["response"]["body"]["object"] == "chat.completion"
    assert out[1]["response"]["body"]["object"] == "text_completion"
    assert out[2]["response"]["status_code"] == 400 and out[2]["error"] is None
    assert out[3]["response"] is None and "POST" in out[3]["error"]["message"]
    assert "4 requests, 2 failed" in capsys.readouterr().err


def test_the_default_model_answers_the_first_chat(monkeypatch):
    """The README's first command (`pagedserve serve`, no model), then its chat request."""
    from pagedserve.models.embedded import DEFAULT_MODEL_INSTALL, default_model_path

    if default_model_path() is None:
        pytest.skip(f"the default model is not installed ({DEFAULT_MODEL_INSTALL})")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(64 / 1024))

    async def check(args, client):
        (model,) = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        assert model == "SmolLM2-135M-Instruct"
        resp = await client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 7, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert "Paris" in resp.json()["choices"][0]["message"]["content"]

    serve(["serve", "--max-model-len", "256"], check, monkeypatch)


def test_the_chat_clients_print_no_library_log_lines(server, caplog, capsys):
    root = logging.getLogger()
    level = root.level
    try:
        assert cli.main(["complete", "--url", server.url + "/v1", "--max-tokens", "3", "-q",
                         "Hello"]) == 0
    finally:
        root.setLevel(level)
    assert not [r for r in caplog.records if "HTTP Request" in r.getMessage()]
    assert "HTTP Request" not in capsys.readouterr().err
