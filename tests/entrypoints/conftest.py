"""Fixtures starting the REAL server (`python -m pagedserve.entrypoints.cli serve ...`) in a
subprocess on a free loopback port, on a tiny random Llama, and waiting for /health.

- `server`: the shared server (session); `server.url`, `server.log_text()`, `server.model`.
- `client` / `async_client_factory`: the official `openai` clients on it (no retries).
- `http`: an `httpx.Client` on it.
- `offline_llm`: the same checkpoint in the offline `LLM`, for comparing outputs.
- `small_engine`: an `LLMEngine` on it for in-process app tests (restore what you patch).
- `logs`: a folder for the logs of servers a test starts itself (`ServerProcess.start`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny  # noqa: E402
from server_utils import (  # noqa: E402
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_KV_BLOCKS,
    SERVER_FLAGS,
    ServerProcess,
)


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny.make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def server(tiny_llama, logs):
    proc = ServerProcess.start(str(tiny_llama), *SERVER_FLAGS, log_dir=logs)
    yield proc
    code = proc.stop()
    assert code == 0, f"the server exited with {code}:\n{proc.log_text()[-3000:]}"


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=30)


@pytest.fixture(scope="session")
def async_client_factory(server):
    """A function making an AsyncOpenAI client (make one per event loop)."""
    import openai

    return lambda: openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0, timeout=30)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="session")
def offline_llm(tiny_llama):
    from pagedserve import LLM

    return LLM(str(tiny_llama), dtype="float32", max_model_len=MAX_MODEL_LEN,
               num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE)


@pytest.fixture(scope="session")
def small_engine(tiny_llama):
    from pagedserve import LLMEngine
    from pagedserve.config import EngineArgs

    return LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", num_kv_blocks=64,
                                max_model_len=128))


# --- reasoning and the Responses API (test_server_reasoning.py, test_responses.py) --------------------

CHAIN_TEXT = "<think>I think so</think>Red car"  # what the chain model writes after "...Assistant:"


@pytest.fixture(scope="session")
def chain_checkpoint(tmp_path_factory) -> Path:
    """A tiny Llama that writes CHAIN_TEXT after a prompt ending in "Assistant:" (the default
    chat template's end), its tokenizer with the think tags (tests/chain_model.py)."""
    import chain_model

    return chain_model.make_chain_checkpoint(tmp_path_factory.mktemp("chain"), "Assistant:",
                                             CHAIN_TEXT)


@pytest.fixture(scope="session")
def reasoning_server(chain_checkpoint, logs):
    """The real server on the chain model with --reasoning-parser deepseek_r1, the hermes tool
    parser and --enable-responses-api-store."""
    proc = ServerProcess.start(str(chain_checkpoint), *SERVER_FLAGS, "--reasoning-parser",
                               "deepseek_r1", "--enable-responses-api-store", log_dir=logs)
    yield proc
    code = proc.stop()
    assert code == 0, f"the server exited with {code}:\n{proc.log_text()[-3000:]}"


@pytest.fixture(scope="session")
def reasoning_client(reasoning_server):
    import openai

    return openai.OpenAI(base_url=reasoning_server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=30)


@pytest.fixture(scope="session")
def http_chain(reasoning_server):
    with httpx.Client(base_url=reasoning_server.url, timeout=30) as c:
        yield c
