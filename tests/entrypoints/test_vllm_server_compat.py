"""vLLM's server behaviours over real HTTP: CORS, /ping, the API-key exemption of /health and
/ping under --root-path, vLLM's error type names, the stop token's text, the model's generation
defaults, --metrics-prefix vllm, /tokenizer_info, and the `pagedserve chat` / `complete` clients.

The shared server (conftest.py) runs with the defaults; `vllm_style` is one more server of the
same tiny Llama, given a generation_config.json and vLLM's optional flags."""

import json
import shutil
import subprocess
import sys

import httpx
import openai
import pytest

from server_utils import MAX_MODEL_LEN, SERVER_FLAGS, ServerProcess, sse_events

pytestmark = pytest.mark.timeout(300)

KEY = "sk-compat"
ORIGIN = "https://ok.example"
EOS = 2  # tests/tiny.py's "</s>"


def _preflight(url: str, origin: str, path: str = "/v1/completions") -> httpx.Response:
    return httpx.options(url + path, timeout=30, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


# --- the shared server: vLLM's defaults --------------------------------------------------------


def test_cors_allows_no_origin_by_default(server, http):
    """vLLM 0.32's default: no cross-origin browser access unless --allowed-origins names some."""
    pre = _preflight(server.url, "https://anywhere.example")
    assert pre.status_code == 400 and "access-control-allow-origin" not in pre.headers
    resp = http.post("/v1/completions", headers={"Origin": "https://anywhere.example"},
                     json={"prompt": "Hi", "max_tokens": 1})
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


def test_ping_answers_get_and_post_like_health(http):
    for method in ("GET", "POST"):
        resp = http.request(method, "/ping")
        assert resp.status_code == 200 and resp.content == b""


def test_error_types_are_vllms_names(client, server, http):
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=1)
    assert missing.value.body["type"] == "NotFoundError"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=server.model, prompt="Hi", max_tokens=1,
                                  temperature=-1)
    assert bad.value.body["type"] == "BadRequestError"
    assert bad.value.body["param"] == "temperature"
    route = http.get("/no/such/route")
    assert route.status_code == 404 and route.json()["error"]["type"] == "Not Found"
    # /tokenizer_info needs --enable-tokenizer-info-endpoint, as in vLLM.
    assert http.get("/tokenizer_info").status_code == 404


def test_the_eos_tokens_text_is_not_in_the_output_unless_asked(http, server):
    body = {"model": server.model, "prompt": [1, 40, 41, 42], "max_tokens": 4,
            "temperature": 0, "logit_bias": {str(EOS): 100}, "skip_special_tokens": False}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["text"] == ""
    kept = http.post("/v1/completions", json={**body, "include_stop_str_in_output": True})
    assert kept.json()["choices"][0]["text"] == "</s>"
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        events = sse_events(resp.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == ""
    chat = http.post("/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4, "temperature": 0, "logit_bias": {str(EOS): 100},
        "skip_special_tokens": False}).json()["choices"][0]
    assert chat["message"]["content"] == "" and chat["finish_reason"] == "stop"


# --- a server with vLLM's optional flags -------------------------------------------------------


@pytest.fixture(scope="module")
def model_with_generation_config(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("with-generation-config") / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 5}))
    return folder


@pytest.fixture(scope="module")
def vllm_style(model_with_generation_config, logs):
    server = ServerProcess.start(
        str(model_with_generation_config), *SERVER_FLAGS, "--served-model-name", "tiny",
        "--api-key", KEY, "--root-path", "/llm", "--allowed-origins", json.dumps([ORIGIN]),
        "--allow-credentials", "--metrics-prefix", "vllm", "--enable-tokenizer-info-endpoint",
        log_dir=logs)
    yield server
    assert server.stop() == 0, server.log_text()[-3000:]


@pytest.fixture(scope="module")
def offline(model_with_generation_config):
    from pagedserve import LLM

    return LLM(str(model_with_generation_config), dtype="float32", max_model_len=MAX_MODEL_LEN,
               num_kv_blocks=256)


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def test_health_and_ping_need_no_key_under_a_root_path(vllm_style):
    # The proxy strips /llm; uvicorn puts it back in front of the path the app sees.
    for path in ("/health", "/ping"):
        assert httpx.get(vllm_style.url + path, timeout=10).status_code == 200, path
    assert httpx.get(vllm_style.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(vllm_style.url + "/v1/models", headers=_auth(), timeout=10).is_success


def test_cors_flags_restrict_the_origins(vllm_style):
    ok = _preflight(vllm_style.url, ORIGIN)  # a preflight carries no key
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert ok.headers["access-control-allow-credentials"] == "true"
    evil = _preflight(vllm_style.url, "https://evil.example")
    assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers
    unauthorized = httpx.get(vllm_style.url + "/v1/models", headers={"Origin": ORIGIN},
                             timeout=10)
    assert unauthorized.status_code == 401
    assert unauthorized.headers["access-control-allow-origin"] == ORIGIN  # readable by JS


def test_the_generation_config_gives_absent_fields_their_defaults(vllm_style, offline):
    client = openai.OpenAI(base_url=vllm_style.url + "/v1", api_key=KEY, max_retries=0,
                           timeout=30)
    messages = [{"role": "user", "content": "Where is the module?"}]
    chat = client.chat.completions.create(model="tiny", messages=messages,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5  # max_new_tokens
    longer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                            extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 8  # the request's own wins
    # temperature 0 from the config: greedy, as offline with the same defaults.
    (ref,) = offline.chat(messages, use_tqdm=False)
    assert chat.choices[0].message.content == ref.outputs[0].text
    log = vllm_style.log_text()
    assert "default sampling parameters from the generation config" in log
    assert "'max_tokens': 5" in log


def test_metrics_carry_vllms_names_with_the_flag(vllm_style):
    text = httpx.get(vllm_style.url + "/metrics", headers=_auth(), timeout=10).text
    assert 'vllm:num_requests_running{model_name="tiny"}' in text
    assert "vllm:generation_tokens_total" in text and "pagedserve:" not in text


def test_tokenizer_info_with_the_flag(vllm_style):
    info = httpx.get(vllm_style.url + "/tokenizer_info", headers=_auth(), timeout=10).json()
    assert info["eos_token"] == "</s>" and info["tokenizer_class"]
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)


def _cli(*args, stdin: str = "") -> str:
    done = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", *args],
                          input=stdin, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_complete_and_chat_clients_talk_to_a_running_server(vllm_style, offline):
    from pagedserve import SamplingParams

    url = vllm_style.url + "/v1"
    out = _cli("complete", "--url", url, "--api-key", KEY, "-q", "The module",
               "--max-tokens", "6")
    ref = offline.generate("The module", SamplingParams(temperature=0.0, max_tokens=6),
                           use_tqdm=False)[0].outputs[0].text
    assert out.splitlines()[0] == "Using model: tiny"
    assert out.split("\n", 1)[1] == ref + "\n"
    # Interactive chat: the conversation (system prompt first) grows with each answer.
    out = _cli("chat", "--url", url, "--api-key", KEY, "--model-name", "tiny",
               "--system-prompt", "Be brief.", stdin="Hello\nAnd then?\n")
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    a1 = offline.chat(first, use_tqdm=False)[0].outputs[0].text
    second = first + [{"role": "assistant", "content": a1},
                      {"role": "user", "content": "And then?"}]
    a2 = offline.chat(second, use_tqdm=False)[0].outputs[0].text
    assert out == (f"Using model: tiny\nPlease enter a message for the chat model:\n"
                   f"> {a1}\n> {a2}\n> ")
    quick = _cli("chat", "--url", url, "--api-key", KEY, "-q", "Hello")
    alone = offline.chat(first[1:], use_tqdm=False)[0].outputs[0].text
    assert quick == f"Using model: tiny\n{alone}\n"


def test_the_clients_report_an_unreachable_server_in_one_line():
    done = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "complete",
                           "--url", "http://127.0.0.1:9/v1", "--model-name", "m", "-q", "x"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.startswith("error: ")
