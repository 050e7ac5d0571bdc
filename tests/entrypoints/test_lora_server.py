"""The server's LoRA adapters (vLLM's flags and routes), on a real server with the openai client:
--lora-modules adapters listed in /v1/models with the base as parent and chosen by name as
`model` (the offline engine's exact outputs), adapters loaded and unloaded at run time while
requests run, bad adapters a 400 naming the problem while the server keeps serving."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

import tiny
from server_utils import SERVER_FLAGS, ServerProcess


@pytest.fixture(scope="module")
def lora_paths(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-adapters")
    return {"sql": tiny.make_lora_adapter(root / "sql", tiny_llama, 8, seed=1),
            "chat16": tiny.make_lora_adapter(root / "chat16", tiny_llama, 16, seed=2,
                                             use_rslora=True, targets=("q_proj", "down_proj"))}


@pytest.fixture(scope="module")
def lora_server(tiny_llama, lora_paths, logs):
    proc = ServerProcess.start(
        str(tiny_llama), *SERVER_FLAGS, "--enable-lora", "--max-loras", "2", "--max-lora-rank",
        "16", "--lora-modules", f"sql={lora_paths['sql']}",
        json.dumps({"name": "chat16", "path": str(lora_paths["chat16"])}),
        "--allow-runtime-lora-updating", log_dir=logs)
    yield proc
    assert proc.stop() == 0, proc.log_text()[-3000:]


@pytest.fixture(scope="module")
def lora_client(lora_server):
    return openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    from pagedserve import LLM
    from server_utils import BLOCK_SIZE, MAX_MODEL_LEN, NUM_KV_BLOCKS

    return LLM(str(tiny_llama), dtype="float32", max_model_len=MAX_MODEL_LEN,
               num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE, enable_lora=True,
               max_loras=2, max_lora_rank=16)


def offline_tokens(offline, lora_paths, name, prompt, n):
    from pagedserve import LoRARequest, SamplingParams

    lora = LoRARequest(name, 7 if name == "sql" else 8, str(lora_paths[name])) if name else None
    out = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                           lora_request=lora, use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_adapters_are_listed_with_the_base_as_parent(lora_client, lora_server):
    models = {m.id: m for m in lora_client.models.list().data}
    base = lora_server.model
    assert set(models) >= {"sql", "chat16"}
    assert models["sql"].parent == base and models["chat16"].parent == base
    assert getattr(models[base], "parent", None) is None


def test_an_adapter_is_chosen_by_its_name_as_model(lora_client, lora_server, offline, lora_paths):
    prompt = "SELECT name FROM"
    for model, name in (("sql", "sql"), ("chat16", "chat16"), (lora_server.model, None)):
        out = lora_client.completions.create(model=model, prompt=prompt, max_tokens=6,
                                             temperature=0.0, extra_body={
                                                 "ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].token_ids == offline_tokens(offline, lora_paths, name, prompt, 6)
        assert out.model == model  # the adapter's name echoed, as vLLM does
    chat = lora_client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.model == "sql"
    chunks = list(lora_client.chat.completions.create(
        model="chat16", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True))
    assert chunks and {c.model for c in chunks} == {"chat16"}
    with pytest.raises(openai.NotFoundError):
        lora_client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_adapters_load_and_unload_at_run_time_while_requests_run(lora_client, lora_server,
                                                                  lora_paths, tmp_path):
    url = lora_server.url
    long_running = {}

    def stream():  # a request with "sql" runs across the unload below
        long_running["text"] = lora_client.completions.create(
            model="sql", prompt="a b c", max_tokens=48, temperature=0.0,
            extra_body={"ignore_eos": True}).choices[0].finish_reason

    t = threading.Thread(target=stream)
    t.start()
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "sql2",
                                                     "lora_path": str(lora_paths["sql"])})
        assert r.status_code == 200 and "sql2" in r.text, r.text
        ids = {m.id for m in lora_client.models.list().data}
        assert "sql2" in ids
        out = lora_client.completions.create(model="sql2", prompt="x y", max_tokens=3)
        assert out.choices[0].finish_reason in ("stop", "length")
        assert http.post("/v1/load_lora_adapter", json={
            "lora_name": "sql2", "lora_path": str(lora_paths["sql"])}).status_code == 400
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"})
        assert r.status_code == 200
        assert "sql2" not in {m.id for m in lora_client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            lora_client.completions.create(model="sql2", prompt="x", max_tokens=2)
        assert http.post("/v1/unload_lora_adapter",
                         json={"lora_name": "sql2"}).status_code == 404
        # bad adapters: 400 naming the problem, the server keeps serving
        (tmp_path / "pickled").mkdir()
        (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"x")
        for path, message in ((tmp_path / "nowhere", "does not exist"),
                              (tmp_path / "pickled", "never unpickles")):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad",
                                                         "lora_path": str(path)})
            assert r.status_code == 400 and message in r.json()["error"]["message"]
    t.join(60)
    assert long_running["text"] == "length"
    out = lora_client.completions.create(model="chat16", prompt="x y", max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")
