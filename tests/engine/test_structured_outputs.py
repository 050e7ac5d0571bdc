"""Structured outputs through the engine on a tiny random model: every output matches its JSON
schema / regex / choice / grammar, over many seeds, greedy and sampled, n > 1, through
preemption, the same on the CPU grammar kernels as on the torch path; invalid constraints are
ValueErrors that leave the engine serving."""

import json
import re

import jsonschema
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.structured_output import StructuredOutputsParams as SO

SCHEMA = {
    "type": "object",
    "properties": {
        # NOTE: not maxLength: xgrammar 0.2.9 lets raw control characters into a string with a
        # maxLength (its character class there lacks \x00-\x1f), which strict JSON refuses.
        "name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "ok", "color"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "maybe not", 'say "hi"']
# sums of one-digit numbers in brackets, at most three terms
GRAMMAR = 'root ::= "[" term (" + " term)? (" + " term)? "]"\nterm ::= [0-9]'
PROMPTS = ["Hello there", "The module", "JSON:", "a b c d e f"]


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints("llama")), dtype="float32", block_size=4,
               kv_cache_memory=1 << 23)


def texts(llm, params, prompts=PROMPTS):
    if isinstance(params, list):  # one prompt per params, cycling through the prompts
        prompts = [prompts[i % len(prompts)] for i in range(len(params))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [c for o in outs for c in o.outputs]


def sampled(so, seeds, **kw):
    return [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=so, **kw)
            for s in seeds]


def test_json_schema_outputs_always_validate_greedy_and_sampled(llm):
    so = SO(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so)]
    outs = texts(llm, params * 4) + texts(llm, sampled(so, range(4), n=3))
    for seed_block in range(3):
        outs += texts(llm, sampled(so, range(10 + 4 * seed_block, 14 + 4 * seed_block)))
    assert len(outs) == 4 + 12 + 12
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_n_sequences_each_follow_their_own_matcher(llm):
    so = SO(regex=EMAIL)
    [out] = llm.generate(["Hello"], SamplingParams(temperature=1.0, seed=7, n=6, max_tokens=40,
                                                   structured_outputs=so), use_tqdm=False)
    got = [c.text for c in out.outputs]
    assert all(re.fullmatch(EMAIL, t) for t in got), got
    assert len(set(got)) > 1  # the sequences really differ, and still each matches


def test_regex_choice_and_grammar_outputs_always_match_over_many_seeds(llm):
    for so, check in (
        (SO(regex=EMAIL), lambda t: re.fullmatch(EMAIL, t)),
        (SO(choice=CHOICES), lambda t: t in CHOICES),
        (SO(grammar=GRAMMAR), lambda t: re.fullmatch(r"\[\d( \+ \d){0,2}\]", t)),
    ):
        outs = texts(llm, sampled(so, range(12))) + texts(
            llm, SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so))
        for c in outs:
            assert c.finish_reason == "stop" and check(c.text), (so.kind, c.text)


def test_json_object_outputs_are_json_objects_or_their_prefixes(llm):
    # The random model rambles inside free JSON: the outputs cut by max_tokens must still be
    # prefixes of a JSON object (a fresh matcher accepts every token), the others parse.
    so = SO(json_object=True, disable_any_whitespace=True)
    outs = texts(llm, [SamplingParams(temperature=1.0, seed=s, max_tokens=60,
                                      structured_outputs=so) for s in range(8)])
    for c in outs:
        assert c.text.startswith("{")
        [matcher] = llm.engine.structured.new_matchers(so, [0]).values()
        assert all(matcher.accept_token(t) for t in c.token_ids), c.text
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length"


def test_the_grammar_wins_over_min_tokens_and_ignore_eos(llm):
    for kw in ({"min_tokens": 30}, {"ignore_eos": True}):
        outs = texts(llm, sampled(SO(choice=CHOICES), range(6), **kw))
        for c in outs:
            assert c.text in CHOICES and c.finish_reason == "stop"


def test_padded_vocabulary_ids_are_never_drawn(llm):
    # the tiny tokenizer has fewer tokens than the model's 512 logits; bias the padding up
    tok = llm.get_tokenizer()
    pad_ids = list(range(len(tok), 512))
    assert pad_ids
    bias = {t: 100.0 for t in pad_ids}
    outs = texts(llm, sampled(SO(regex=EMAIL), range(6), logit_bias=bias))
    for c in outs:
        assert not set(c.token_ids) & set(pad_ids) and re.fullmatch(EMAIL, c.text)


def test_outputs_are_unchanged_by_recompute_and_swap_preemption(checkpoints, llm):
    so = SO(json=SCHEMA, disable_any_whitespace=True)
    params = sampled(so, range(8))
    prompts = PROMPTS * 2
    ref = [c.token_ids for c in texts(llm, params, prompts)]
    for mode in ("recompute", "swap"):
        # NOTE: 32 blocks of 4: one sequence at max_tokens=120 fits alone (admission), 16 do not
        small = LLM(str(checkpoints("llama")), dtype="float32", block_size=4, num_kv_blocks=32,
                    num_cpu_blocks=40, preemption_mode=mode)
        outs = texts(small, params, prompts)
        assert small.engine.scheduler.num_preemptions > 0, mode
        assert [c.token_ids for c in outs] == ref, mode
        for c in outs:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        assert small.engine.kv_manager.pool.num_used == 0


def test_the_cpu_kernels_and_the_torch_path_give_the_same_outputs(llm, monkeypatch):
    from pagedserve.kernels import cpu_grammar

    if not cpu_grammar.available():
        pytest.skip("grammar-mask kernels unavailable here")
    so = SO(json=SCHEMA, disable_any_whitespace=True)
    params = ([SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so)] * 2
              + [SamplingParams(temperature=0.0, max_tokens=40, logprobs=2,
                                structured_outputs=SO(regex=EMAIL))]
              + sampled(so, range(3)) + sampled(SO(choice=CHOICES), range(2), logprobs=1))

    def run():
        return [(c.token_ids, c.logprobs) for c in texts(llm, params)]

    fast = run()
    monkeypatch.setattr(cpu_grammar, "available", lambda: False)
    assert run() == fast


def test_a_bad_constraint_is_a_value_error_and_the_engine_keeps_serving(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        engine.add_request("bad", "Hello", SamplingParams(
            structured_outputs={"regex": "[unclosed"}))
    assert "bad" not in engine.groups
    [c] = texts(llm, SamplingParams(temperature=0.0, max_tokens=20,
                                    structured_outputs=SO(choice=["ok"])), ["Hi"])
    assert c.text == "ok"
