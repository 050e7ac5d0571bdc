"""The think-tag reasoning parsers (pagedserve/reasoning/) on text and token ids, as vLLM's parsers of
the same names read them; streamed deltas always add up to the whole text's split."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pagedserve.reasoning import make_reasoning_parser, reasoning_parser_class  # noqa: E402

R1 = reasoning_parser_class("deepseek_r1")(7, 8)
QWEN3 = reasoning_parser_class("qwen3")(7, 8)


@pytest.mark.parametrize("parser", [R1, QWEN3])
@pytest.mark.parametrize("text, want", [
    ("<think>plan</think>answer", ("plan", "answer")),
    ("plan</think>answer", ("plan", "answer")),  # <think> in the prompt (R1, Qwen3.5)
    ("\n<think>plan</think>\n\nanswer", ("plan", "\n\nanswer")),
    ("<think>cut short while thinking", ("cut short while thinking", None)),
    ("no tags at all", ("no tags at all", None)),
    ("<think>plan</think>", ("plan", None)),
    ("a</think>b</think>c", ("a", "b</think>c")),
])
def test_split_reads_the_text_before_the_end_tag_as_reasoning(parser, text, want):
    assert parser.split(text) == want


def test_qwen3_with_thinking_off_is_all_content():
    assert not QWEN3.thinking({"enable_thinking": False})
    assert not QWEN3.thinking({"thinking": False})
    assert QWEN3.thinking({"enable_thinking": True}) and QWEN3.thinking(None)
    assert QWEN3.split("plan</think>answer", thinking=False) == (None, "plan</think>answer")
    # deepseek_r1 has no switch
    assert R1.thinking({"enable_thinking": False})


def test_a_prompt_that_ended_the_reasoning_makes_the_output_content():
    assert R1.is_reasoning_end([1, 7, 5, 8, 3])
    assert not R1.is_reasoning_end([1, 8, 5, 7, 3])  # a new <think> opened after an old end
    assert not R1.is_reasoning_end([1, 2, 3])
    assert R1.split("x</think>y", prompt_ended=True) == (None, "x</think>y")


def test_the_end_tag_token_ends_the_reasoning_and_counts():
    assert R1.ends_reasoning(8) and not R1.ends_reasoning(7)
    assert R1.reasoning_tokens([7, 4, 4, 8, 5], True) == 3
    assert R1.reasoning_tokens([4, 4], True) == 2
    assert R1.reasoning_tokens([4, 4], False) == 0


def _pieces(text: str, sizes) -> list[str]:
    out, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        out.append(text[i:i + n])
        i, k = i + n, k + 1
    return out


@pytest.mark.parametrize("text", [
    "<think>plan it</think>the answer", "plan</think>x", "  <think>a<b</think>c</thin",
    "<thi", "<think>never ends </thi", "no tags", "<", "a</think>", "</think>only content",
])
@pytest.mark.parametrize("sizes", [[1], [2, 3], [5], [100]])
@pytest.mark.parametrize("kw", [{}, {"thinking": False}, {"prompt_ended": True}])
def test_streamed_deltas_add_up_to_the_split_of_the_whole_text(text, sizes, kw):
    stream = R1.stream(**kw)
    reasoning = content = ""
    pieces = _pieces(text, sizes)
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    want_r, want_c = R1.split(text, **kw)
    assert (reasoning, content) == (want_r or "", want_c or "")


def test_a_partial_end_tag_is_held_back_until_it_is_known():
    stream = R1.stream()
    assert stream.feed("plan</th", False) == ("plan", "")
    assert stream.feed("ink>ans", False) == ("", "ans")
    stream = R1.stream()
    assert stream.feed("a</th", False) == ("a", "")
    assert stream.feed("e", True) == ("</the", "")


def test_make_needs_the_think_tags_as_tokens():
    import chain_model
    import tiny

    tok = chain_model.think_tokenizer()
    parser = make_reasoning_parser("qwen3", tok)
    assert (parser.start_token_id, parser.end_token_id) == tuple(
        tok.convert_tokens_to_ids(chain_model.THINK_TAGS))
    with pytest.raises(ValueError, match="no <think> or </think> token"):
        make_reasoning_parser("deepseek_r1", tiny.tokenizer())
    with pytest.raises(ValueError, match="must be one of"):
        make_reasoning_parser("no_such_parser", tok)
