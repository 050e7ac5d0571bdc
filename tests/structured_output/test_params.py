"""StructuredOutputsParams: exactly one constraint, each checked when the request is made, with a
ValueError naming the field and the problem."""

import pytest

from pagedserve import SamplingParams
from pagedserve.structured_output import StructuredOutputsParams
from pagedserve.structured_output.params import choice_grammar


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"regex": "a+", "choice": ["a"]}, "got regex, choice"),
    ({"json": '{"type": '}, "structured_outputs.json is not valid JSON"),
    ({"json": {"type": "no-such-type"}}, "structured_outputs.json is not a supported JSON schema"),
    ({"json": 3}, "structured_outputs.json must be a JSON schema"),
    ({"regex": "a(b"}, "structured_outputs.regex is not a valid regular expression"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": ["a", 3]}, "structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": ["a", ""]}, "must not contain an empty string"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar is not a valid EBNF"),
    ({"json_object": True, "disable_any_whitespace": "yes"}, "disable_any_whitespace must be"),
])
def test_invalid_constraints_raise_value_errors_naming_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_xgrammar_messages_lose_their_log_prefix():
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(regex="a(b")
    assert "parenthesis is not closed" in str(info.value)
    assert ".cc:" not in str(info.value) and "[" not in str(info.value).split(":", 1)[1][:4]


def test_valid_constraints_are_accepted_and_report_their_kind():
    assert StructuredOutputsParams(json={"type": "object"}).kind == "json"
    assert StructuredOutputsParams(json='{"type": "integer"}').kind == "json"
    assert StructuredOutputsParams(regex=r"\d{3}").kind == "regex"
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]
    assert StructuredOutputsParams(grammar='root ::= "x" | "y"').kind == "grammar"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_a_lark_grammar_is_accepted_as_ebnf():
    so = StructuredOutputsParams(grammar='start: "yes" | "no"')
    assert "root" in so.grammar or "start" in so.grammar


def test_choice_grammar_escapes_quotes_backslashes_and_newlines():
    import xgrammar as xgr

    choices = ['say "hi"', "back\\slash", "two\nlines"]
    grammar = xgr.Grammar.from_ebnf(choice_grammar(choices))
    assert grammar is not None


def test_disable_additional_properties_closes_every_object():
    so = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}}}},
        disable_additional_properties=True)
    assert '"additionalProperties": false' in so.schema_text()
    assert so.schema_text().count('"additionalProperties": false') == 2


def test_sampling_params_take_a_dict_and_refuse_beam_search():
    p = SamplingParams(structured_outputs={"regex": "a+"})
    assert isinstance(p.structured_outputs, StructuredOutputsParams)
    with pytest.raises(ValueError, match="structured_outputs: .*unexpected keyword"):
        SamplingParams(structured_outputs={"regexp": "a+"})
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="a+")
    with pytest.raises(ValueError, match="structured_outputs is not supported with use_beam_search"):
        SamplingParams(structured_outputs={"regex": "a+"}, use_beam_search=True, temperature=0,
                       n=2)


def test_sampling_params_with_structured_outputs_survive_clone_and_pickle():
    import pickle

    p = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert p.clone().structured_outputs == p.structured_outputs
    assert pickle.loads(pickle.dumps(p)).structured_outputs == p.structured_outputs
