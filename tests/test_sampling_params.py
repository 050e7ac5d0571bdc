"""SamplingParams: vLLM's defaults, normalisations and validation."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pagedserve.sampling_params import SamplingParams, SamplingType

# vLLM's SamplingParams defaults.
VLLM_DEFAULTS = {
    "n": 1,
    "best_of": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "logit_bias": None,
    "structured_outputs": None,
    # vLLM v0's beam-search fields (its server's `use_beam_search`, `length_penalty`)
    "use_beam_search": False,
    "length_penalty": 1.0,
    # vLLM's allowed_token_ids, bad_words (tokenized by the engine), cache_salt
    "allowed_token_ids": None,
    "bad_words": None,
    "bad_words_token_ids": None,
    "cache_salt": None,
}


def test_defaults_match_vllm():
    params = SamplingParams()
    assert {f.name: getattr(params, f.name) for f in dataclasses.fields(params)} == VLLM_DEFAULTS
    assert params.sampling_type is SamplingType.RANDOM
    assert not params.is_greedy
    assert params.output_text_buffer_length == 0


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": True}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 0}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": None}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": 0.0, "temperature": 0.0}, "top_p"),  # validated even when greedy
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": -1.0}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"temperature": 0.0, "n": 2}, "n"),
        ({"temperature": 0.0, "best_of": 2}, "best_of"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 8.0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),  # > max_tokens=16
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"logit_bias": {1.5: 1.0}}, "logit_bias"),
        ({"logit_bias": {-3: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: math.inf}}, "logit_bias"),
        ({"logit_bias": {1: math.nan}}, "logit_bias"),
        ({"logit_bias": {1: "x"}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"spaces_between_special_tokens": "yes"}, "spaces_between_special_tokens"),
        ({"include_stop_str_in_output": 0}, "include_stop_str_in_output"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_parameter(kwargs, param):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    message = str(excinfo.value)
    assert message.split()[0] == param, message


def test_boundary_values_are_accepted():
    SamplingParams(
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=1e-3,
        temperature=5.0,
        top_p=1e-6,
        top_k=1,
        min_p=1.0,
        max_tokens=1,
        min_tokens=1,
        logprobs=0,
        prompt_logprobs=0,
        seed=0,
    )
    SamplingParams(max_tokens=None, min_tokens=10_000)  # no cap until the engine resolves it
    SamplingParams(n=2, best_of=3, temperature=0.7)


def test_normalisations():
    p = SamplingParams(
        top_k=-1,
        seed=-1,
        stop="###",
        stop_token_ids=(5, 3, 5, 7, 3),
        logprobs=True,
        prompt_logprobs=False,
        logit_bias={"12": 5, 7: -1.5, " 3 ": 0},
    )
    assert p.top_k == 0
    assert p.seed is None
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 3, 7]
    assert p.logprobs == 1 and p.prompt_logprobs is None
    assert p.logit_bias == {12: 5.0, 7: -1.5, 3: 0.0}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    assert SamplingParams(n=3).best_of is None
    assert SamplingParams(n=3).effective_best_of == 3
    assert SamplingParams(n=3, best_of=5).effective_best_of == 5
    assert type(SamplingParams(temperature=1).temperature) is float


def test_greedy_ignores_truncation_knobs():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2)
    assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=5e-6).is_greedy
    assert SamplingParams(temperature=0, seed=3).sampling_type is SamplingType.GREEDY


def test_tiny_positive_temperature_is_clamped():
    p = SamplingParams(temperature=1e-3)
    assert p.temperature == 1e-2 and not p.is_greedy
    assert SamplingParams(temperature=0.5).temperature == 0.5


def test_sampling_type_with_seed():
    assert SamplingParams(seed=1234).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED


def test_output_text_buffer_length():
    assert SamplingParams(stop=["a", "abcd"]).output_text_buffer_length == 3
    kept = SamplingParams(stop=["abcd"], include_stop_str_in_output=True)
    assert kept.output_text_buffer_length == 0


def test_clone_is_deep_and_equal():
    p = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={1: 1.0}, seed=3)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(2)
    q.logit_bias[2] = 2.0
    assert p.stop == ["x"] and p.stop_token_ids == [1] and p.logit_bias == {1: 1.0}


def test_replace_revalidates():
    p = SamplingParams(temperature=0.5, stop="x")
    assert dataclasses.replace(p, n=2).n == 2
    with pytest.raises(ValueError, match="^top_p"):
        dataclasses.replace(p, top_p=2.0)


def test_beam_search_needs_greedy_temperature_and_allows_n_above_one():
    SamplingParams(n=4, temperature=0.0, use_beam_search=True, max_tokens=8)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(n=4, temperature=0.7, use_beam_search=True)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=2, best_of=3, temperature=0.0, use_beam_search=True)
    with pytest.raises(ValueError, match="length_penalty"):
        SamplingParams(n=2, temperature=0.0, use_beam_search=True, length_penalty=float("nan"))


@pytest.mark.parametrize("kw,name", [
    ({"cache_salt": ""}, "cache_salt"), ({"cache_salt": 3}, "cache_salt"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"bad_words": ["ok", 3]}, "bad_words"),
])
def test_vllm_request_extras_are_validated_naming_the_parameter(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)
