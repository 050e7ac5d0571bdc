"""Structured outputs with a reasoning parser (engine option `reasoning_parser`): the grammar
waits for the end of the reasoning, as vLLM's does. On a model that writes
``<think>I think so</think>Red car`` (tests/chain_model.py): the reasoning is generated as
without a constraint (same tokens, same logprobs), ``</think>`` is left to the model, and only
the answer after it follows the grammar; a prompt that already ended the reasoning constrains at
once; no parser: the grammar applies from the first token."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import chain_model  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.structured_output import StructuredOutputsParams  # noqa: E402

TEXT = "<think>I think so</think>Red car"
PROMPT = "<s>User: hi\n\nAssistant:"
CHOICE = StructuredOutputsParams(choice=["yes", "no"])


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    return chain_model.make_chain_checkpoint(tmp_path_factory.mktemp("chain"), "Assistant:", TEXT)


def _llm(path, parser):
    return LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=16,
               reasoning_parser=parser)


@pytest.fixture(scope="module")
def llms(chain):
    """parser -> an LLM on the chain model (made once per parser)."""
    made: dict = {}

    def get(parser):
        if parser not in made:
            made[parser] = _llm(chain, parser)
        return made[parser]

    return get


def _run(llm, prompt, **kw):
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=0, **kw)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert llm.engine.num_used_blocks() == 0
    return out.outputs[0]


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_grammar_applies_only_after_the_reasoning(llms, parser):
    llm = llms(parser)
    free = _run(llm, PROMPT)
    assert free.text == TEXT  # the chain model writes its text (no constraint)
    end = llm.get_tokenizer().convert_tokens_to_ids("</think>")
    cut = free.token_ids.index(end) + 1
    constrained = _run(llm, PROMPT, structured_outputs=CHOICE)
    assert constrained.text in ("<think>I think so</think>yes", "<think>I think so</think>no")
    assert constrained.token_ids[:cut] == free.token_ids[:cut]
    assert constrained.logprobs[:cut] == free.logprobs[:cut]  # unmasked while reasoning
    assert constrained.finish_reason == "stop"


def test_without_a_parser_the_grammar_applies_from_the_first_token(llms):
    out = _run(llms(None), PROMPT, structured_outputs=CHOICE)
    assert out.text in ("yes", "no")


def test_a_prompt_that_ended_the_reasoning_constrains_at_once(llms):
    llm = llms("deepseek_r1")
    ended = "<s>User: <think>hm</think>hi\n\nAssistant:"
    assert _run(llm, ended).text == TEXT  # the model would think again...
    assert _run(llm, ended, structured_outputs=CHOICE).text in ("yes", "no")  # ...but may not


def test_a_tokenizer_without_think_tags_is_refused(tmp_path):
    import tiny

    path = tiny.make_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="no <think> or </think> token"):
        _llm(path, "qwen3")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        _llm(path, "no_such_parser")
