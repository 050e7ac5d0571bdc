"""vLLM's `LLM` methods beyond generate (engine/llm_extras.py), the model's generation defaults
(engine/generation_config.py) and the stop token's text, on a tiny random Llama."""

import gc
import json
import shutil
import weakref

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.generation_config import diff_sampling_params
from pagedserve.models.source import ModelSource

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Where is the module?"}]


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints("llama")), dtype="float32", block_size=4, num_kv_blocks=96,
               max_model_len=256)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_chat_equals_generate_on_the_rendered_template(llm):
    tok = llm.get_tokenizer()
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if tools %}tools: {{ tools | length }}\n{% endif %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    second = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                           {"type": "text", "text": "b"}]}]
    outs = llm.chat([CONVERSATION, second], GREEDY, use_tqdm=False, chat_template=template,
                    tools=tools)
    rendered = [tok.apply_chat_template(c, chat_template=template, tools=tools, tokenize=False,
                                        add_generation_prompt=True)
                for c in (CONVERSATION, [{"role": "user", "content": "a\nb"}])]
    assert [o.prompt for o in outs] == rendered and "tools: 1" in rendered[0]
    refs = llm.generate([{"prompt_token_ids": tok(r, add_special_tokens=False).input_ids}
                         for r in rendered], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [r.prompt_token_ids for r in refs]
    assert _ids(outs) == _ids(refs) and all(len(i) == 6 for i in _ids(outs))
    # One conversation (not a list of them), the tokenizer's default format, continuing the
    # last message instead of opening a new turn.
    (one,) = llm.chat(CONVERSATION + [{"role": "assistant", "content": "It is"}], GREEDY,
                      use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert one.prompt.endswith("Assistant: It is")
    # "openai": the content reaches the template as a list of text parts.
    parts = ("{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}"
             "{% endfor %}")
    (listed,) = llm.chat(second, GREEDY, use_tqdm=False, chat_template=parts,
                         chat_template_content_format="openai")
    assert listed.prompt == "<a\nb>"


def test_chat_refuses_bad_conversations_before_running_any(llm):
    for bad, word in (([CONVERSATION, []], r"messages\[1\]"), ([{"content": "x"}], "role"),
                      ("hello", "messages")):
        with pytest.raises(ValueError, match=word):
            llm.chat(bad, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(CONVERSATION, GREEDY, use_tqdm=False, continue_final_message=True)
    assert not llm.engine.has_unfinished_requests() and llm.engine.num_used_blocks() == 0


def test_chat_adds_the_default_gemma_formats_end_of_turn_stop(llm, monkeypatch):
    # NOTE: the stop tokens of the server's chat format (Gemma's <end_of_turn> for the
    # embedded GGUF) join the request's, as /v1/chat/completions adds them.
    from pagedserve.engine.chat_template import PLAIN_TEMPLATE, ChatFormat

    monkeypatch.setattr(llm, "_chat_format_cache", ChatFormat("test", PLAIN_TEMPLATE, [7]),
                        raising=False)
    seen = []
    monkeypatch.setattr(llm, "generate",
                        lambda prompts, params, use_tqdm, **kw: seen.append(params))
    llm.chat(CONVERSATION, SamplingParams(stop_token_ids=[9]), use_tqdm=False)
    assert seen[0].stop_token_ids == [9, 7]


def _with_generation_config(checkpoints, tmp_path, **config):
    folder = tmp_path / "model"
    shutil.copytree(checkpoints("llama"), folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, **config}))
    return folder


def test_generation_config_gives_the_defaults_and_explicit_params_win(checkpoints, tmp_path):
    folder = _with_generation_config(checkpoints, tmp_path, temperature=0.0, top_k=20,
                                     top_p=0.9, repetition_penalty=1.1, max_new_tokens=5,
                                     do_sample=False)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, max_model_len=128)
    expected = SamplingParams(temperature=0.0, top_k=20, top_p=0.9, repetition_penalty=1.1,
                              max_tokens=5)
    assert llm.get_default_sampling_params() == expected
    default = llm.generate("The module", use_tqdm=False)[0].outputs[0]
    ref = llm.generate("The module", expected, use_tqdm=False)[0].outputs[0]
    assert default.token_ids == ref.token_ids and len(default.token_ids) <= 5
    explicit = llm.generate("The module", SamplingParams(max_tokens=9, temperature=0.0,
                                                         ignore_eos=True), use_tqdm=False)
    assert len(explicit[0].outputs[0].token_ids) == 9
    # "vllm": the neutral defaults; a folder: its generation_config.json.
    neutral = LLM(str(folder), dtype="float32", num_kv_blocks=64, max_model_len=128,
                  generation_config="vllm")
    assert neutral.get_default_sampling_params() == SamplingParams()
    source = ModelSource("m", "hf", checkpoints("llama"), None)
    assert diff_sampling_params(source, str(folder))["max_tokens"] == 5
    assert diff_sampling_params(source, "auto") == {}  # its config sets no sampling field
    with pytest.raises(ValueError, match="generation_config"):
        diff_sampling_params(source, str(tmp_path / "nowhere"))
    bad = _with_generation_config(checkpoints, tmp_path / "bad", top_p=1.5)
    with pytest.raises(ValueError, match="generation_config.*top_p"):
        diff_sampling_params(source, str(bad))


def test_override_generation_config_sets_fields_over_the_config(checkpoints, tmp_path):
    folder = _with_generation_config(checkpoints, tmp_path, temperature=0.7, top_k=20)
    source = ModelSource("m", "hf", folder, None)
    over = {"temperature": 0.5, "max_new_tokens": 3, "do_sample": True}
    assert diff_sampling_params(source, "auto", over) == {"temperature": 0.5, "top_k": 20,
                                                          "max_tokens": 3}
    assert diff_sampling_params(source, "vllm", over) == {"temperature": 0.5, "max_tokens": 3}
    # The flag's JSON text and a dict from Python are the same option.
    from pagedserve.config import EngineArgs

    assert EngineArgs(override_generation_config='{"top_p": 0.5}').override_generation_config \
        == {"top_p": 0.5}
    with pytest.raises(ValueError, match="override_generation_config"):
        EngineArgs(override_generation_config="[1]")


def test_a_gguf_model_has_no_generation_defaults(tmp_path):
    # As vLLM: a GGUF file's header carries no generation config (the embedded model).
    assert diff_sampling_params(ModelSource("x.gguf", "gguf", tmp_path, None), "auto") == {}


def test_the_stop_tokens_text_is_left_out_unless_include_stop_str_in_output(llm):
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    prompt = {"prompt_token_ids": tok("The module").input_ids}
    base = dict(temperature=0.0, max_tokens=4, skip_special_tokens=False)
    out = llm.generate(prompt, SamplingParams(**base, logit_bias={eos: 100.0}),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""
    kept = llm.generate(prompt, SamplingParams(**base, logit_bias={eos: 100.0},
                                               include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == tok.eos_token
    # A stop token id that is an ordinary token: its text is left out too.
    free = llm.generate(prompt, SamplingParams(**base, ignore_eos=True), use_tqdm=False)
    free_ids = free[0].outputs[0].token_ids
    stop = llm.generate(prompt, SamplingParams(**base, stop_token_ids=[free_ids[2]]),
                        use_tqdm=False)[0].outputs[0]
    first = free_ids.index(free_ids[2])
    assert stop.token_ids == free_ids[:first + 1]
    assert stop.text == tok.decode(free_ids[:first])


def test_reset_prefix_cache_and_get_metrics(llm):
    prompt = {"prompt_token_ids": list(range(3, 40))}
    before = {(m.name, m.labels.get("finished_reason")): m.value for m in llm.get_metrics()}
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    after = {(m.name, m.labels.get("finished_reason")): m.value for m in llm.get_metrics()}
    assert after[("vllm:generation_tokens", None)] - before[("vllm:generation_tokens", None)] == 18
    assert (after[("vllm:request_success", "length")]
            - before.get(("vllm:request_success", "length"), 0)) == 3
    assert after[("vllm:num_requests_running", None)] == 0
    # Not while a request holds blocks.
    llm.engine.add_request("held", None, GREEDY, prompt_token_ids=list(range(3, 40)))
    llm.engine.step()
    assert llm.reset_prefix_cache() is False
    llm.engine.abort_request("held")
    assert llm.engine.num_used_blocks() == 0


def test_sleep_frees_the_kv_cache_and_wake_up_serves_the_same_tokens(llm):
    prompt = {"prompt_token_ids": list(range(3, 30))}
    ref = _ids(llm.generate(prompt, GREEDY, use_tqdm=False))
    tensor = weakref.ref(llm.engine.kv_cache.layers[0][0])
    llm.sleep(level=1)
    gc.collect()
    assert llm.is_sleeping() and tensor() is None  # the KV tensors are gone
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=2)
    llm.wake_up(tags=["weights"])  # the weights never left: still asleep
    assert llm.is_sleeping()
    queries = {m.name: m.value for m in llm.get_metrics()}["vllm:prefix_cache_queries"]
    llm.wake_up()
    assert not llm.is_sleeping()
    assert _ids(llm.generate(prompt, GREEDY, use_tqdm=False)) == ref
    # The counters carry on over the rebuilt block manager.
    assert {m.name: m.value for m in llm.get_metrics()}["vllm:prefix_cache_queries"] > queries
    assert llm.engine.num_used_blocks() == 0
    # Not with requests in flight.
    llm.engine.add_request("busy", None, GREEDY, prompt_token_ids=[3, 4, 5])
    with pytest.raises(ValueError, match="in flight"):
        llm.sleep()
    llm.engine.abort_request("busy")


def test_collective_rpc_runs_on_every_worker(llm):
    assert llm.collective_rpc(lambda worker, x: (worker.rank, x), args=(5,)) == [(0, 5)]
    assert llm.collective_rpc("info")[0].num_params > 0
