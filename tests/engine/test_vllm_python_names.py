"""vLLM's Python names (issue 37): `llm.llm_engine`, `AsyncLLMEngine.from_engine_args`,
`AsyncEngineArgs`, `TokensPrompt` / `TextPrompt`, a bare list of token ids as a prompt,
`LLM(task=...)` / `convert=`, `LLM(kv_cache_memory_bytes=...)`, the progress bar's tokens/s and
the offline engine's start logged as the server's."""

from __future__ import annotations

import logging

import pytest

from pagedserve import (
    LLM,
    AsyncEngineArgs,
    AsyncLLMEngine,
    EngineArgs,
    SamplingParams,
    TextPrompt,
    TokensPrompt,
)


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints("llama")), dtype="float32", kv_cache_memory_bytes=1 << 20,
               max_model_len=128, seed=0)


def test_vllm_names_of_the_engine_and_its_options(llm, checkpoints):
    assert llm.llm_engine is llm.engine and llm.engine.args.kv_cache_memory == 1 << 20
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(str(checkpoints("llama")), kv_cache_bytes=1)
    with pytest.raises(ValueError, match="task must be one of"):
        LLM(str(checkpoints("llama")), task="transcribe")
    args = AsyncEngineArgs(model=str(checkpoints("llama")), dtype="float32", num_kv_blocks=16)
    assert isinstance(args, EngineArgs)
    engine = AsyncLLMEngine.from_engine_args(args)
    assert isinstance(engine, AsyncLLMEngine) and engine.engine.args is args
    assert not engine.started


def test_token_prompts_in_every_spelling_give_the_same_tokens(llm, capsys):
    params = SamplingParams(max_tokens=6, temperature=0.0)
    ids = llm.get_tokenizer().encode("hello world")
    outs = llm.generate([ids, TokensPrompt(prompt_token_ids=ids), {"prompt_token_ids": ids}],
                        params, use_tqdm=True)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == \
        outs[2].outputs[0].token_ids
    (single,) = llm.generate(ids, params, use_tqdm=False)  # one bare list: one prompt
    assert single.prompt_token_ids == ids and single.outputs[0].token_ids == outs[0].outputs[0].token_ids
    (text,) = llm.generate(TextPrompt(prompt="hello world"), params, use_tqdm=False)
    assert text.prompt == "hello world" and text.outputs[0].text
    bar = capsys.readouterr().err
    assert "est. speed input:" in bar and "toks/s, output:" in bar


def test_convert_embed_and_task_choose_the_pooling_runner(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", num_kv_blocks=16, task="embed")
    assert llm.engine.runner == "pooling"
    (out,) = llm.embed(["hello"], use_tqdm=False)
    assert len(out.outputs.embedding) == llm.engine.model_config.hidden_size


def test_offline_engine_logs_its_start_like_the_server(checkpoints, monkeypatch, capsys):
    from pagedserve.engine import llm as llm_module

    ours = logging.getLogger("pagedserve")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # nothing configured logging
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    llm_module.configure_logging()
    assert ours.handlers and ours.level == logging.INFO
    LLM.from_engine_args(EngineArgs(model=str(checkpoints("llama")), dtype="float32",
                                    num_kv_blocks=16, max_model_len=64))
    err = capsys.readouterr().err
    assert "engine ready:" in err and "GiB" in err and "maximum concurrency" in err
