"""Every reasoning parser (`--reasoning-parser`, vLLM's names) on model text shaped like vLLM's
own reasoning tests: the split of a whole output into reasoning and content, the same split
streamed token by token (markers as single tokens) and in irregular chunks, the thinking
switches, and the token-id side the engine uses (markers of one token or several)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pagedserve.reasoning import (  # noqa: E402
    REASONING_PARSERS,
    make_reasoning_parser,
    reasoning_parser_class,
)

OFF = {"enable_thinking": False}
ON = {"thinking": True}

# parser -> [(text, chat_template_kwargs, reasoning, content)]
CASES: dict[str, list[tuple[str, dict | None, str | None, str | None]]] = {
    "deepseek_r1": [
        ("<think>This is a reasoning section</think>This is the rest", None,
         "This is a reasoning section", "This is the rest"),
        ("This is a reasoning section</think>This is the rest", None,
         "This is a reasoning section", "This is the rest"),
        ("<think>This is a reasoning section", None, "This is a reasoning section", None),
        ("<think>This is a reasoning section</think>", None, "This is a reasoning section",
         None),
        ("<think>multi\nline</think>\n\nanswer", None, "multi\nline", "\n\nanswer"),
    ],
    "qwen3": [
        ("<think>I should add.</think>It is 4.", None, "I should add.", "It is 4."),
        ("I should add.</think>It is 4.", None, "I should add.", "It is 4."),
        ("It is 4.", OFF, None, "It is 4."),
        ("<think></think>It is 4.", None, "", "It is 4."),
    ],
    "deepseek_v3": [
        ("It is 4.", None, None, "It is 4."),  # thinks only when asked
        ("<think>let me add</think>It is 4.", None, None, "<think>let me add</think>It is 4."),
        ("let me add</think>It is 4.", ON, "let me add", "It is 4."),
        ("let me add</think>It is 4.", {"enable_thinking": True}, "let me add", "It is 4."),
    ],
    "glm45": [
        ("<think>The user greets.</think>Hello!", None, "The user greets.", "Hello!"),
        ("\nThe user greets.</think>Hello!", None, "\nThe user greets.", "Hello!"),
        ("Hello!", OFF, None, "Hello!"),
    ],
    "seed_oss": [
        ("<seed:think>Check the budget.</seed:think>Done.", None, "Check the budget.",
         "Done."),
        ("Check the budget.</seed:think>Done.", None, "Check the budget.", "Done."),
        ("Still thinking", None, "Still thinking", None),
    ],
    "step3": [
        ("Think about it.</think>The answer.", None, "Think about it.", "The answer."),
        ("Think about it.", None, "Think about it.", None),
    ],
    "kimi_k2": [
        ("<think>Plan the call.</think>Calling now.", None, "Plan the call.", "Calling now."),
        ("Calling now.", {"thinking": False}, None, "Calling now."),
    ],
    "minimax_m2": [
        ("The user wants X.</think>\n\nHere is X.", None, "The user wants X.", "\n\nHere is X."),
    ],
    "olmo3": [
        ("<think>Count the letters.</think>There are 3.", None, "Count the letters.",
         "There are 3."),
    ],
    "mistral": [
        ("[THINK]Let me compute.[/THINK]The result is 7.", None, "Let me compute.",
         "The result is 7."),
        ("<think>Old tokenizer.</think>Text tags.", None, "Old tokenizer.", "Text tags."),
        ("The result is 7.", None, None, "The result is 7."),  # did not think
        ("[THINK]Cut short", None, "Cut short", None),
    ],
    "granite": [
        ("Here is my thought process: 2 and 2. Here is my response: 4.", None,
         " 2 and 2. ", " 4."),
        ("Here's my thought process: hmm Here's my response: ok", None, " hmm ", " ok"),
        ("Here is my answer: 4.", None, None, "Here is my answer: 4."),
        ("Here is my thought process: still going", None, " still going", None),
    ],
    "hunyuan_a13b": [
        ("<think>\nWork it out.\n</think>\n<answer>\nThe result.\n</answer>", None,
         "Work it out.", "The result."),
        ("<think>\nWork it out.\n</think>\nNo wrapper.", None, "Work it out.", "No wrapper."),
    ],
    "ernie45": [
        ("Think it through.\n</think>\n\n\n<response>\nThe answer.\n</response>\n", None,
         "Think it through.\n", "\nThe answer.\n"),
        ("Think it through.</think>The answer.", None, "Think it through.", "The answer."),
    ],
    "openai_gptoss": [
        ("<|channel|>analysis<|message|>User asks for 2+2.<|end|><|start|>assistant"
         "<|channel|>final<|message|>4", None, "User asks for 2+2.", "4"),
        ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
         "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
         '{"city": "Tokyo"}', None, "Need the weather.",
         "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
         '<|message|>{"city": "Tokyo"}'),
        ("<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis"
         "<|message|>two<|end|><|start|>assistant<|channel|>final<|message|>done", None,
         "one\ntwo", "done"),
        ("<|channel|>final<|message|>Just the answer.", None, None, "Just the answer."),
        ("Plain text without harmony.", None, None, "Plain text without harmony."),
    ],
}
ALIASES = {"glm47": "glm45"}
PARAMS = [(name, i, case) for name in REASONING_PARSERS
          for i, case in enumerate(CASES[ALIASES.get(name, name)])]
IDS = [f"{n}-{i}" for n, i, _ in PARAMS]

MARKERS = sorted({m for m in re.findall(r"<\|[a-z_]+\|>|\[/?THINK\]|</?[a-z_:]+>",
                                        " ".join(c[0] for cs in CASES.values() for c in cs))},
                 key=len, reverse=True)
_TOKEN = re.compile("|".join(map(re.escape, MARKERS)) + r"|\w{1,4}|\s|[^\w\s]")


def parser_of(name):
    return reasoning_parser_class(name)(1, 2)


def _split(text, sizes):
    if sizes == "tokens":
        pieces = _TOKEN.findall(text)
        assert "".join(pieces) == text
        return pieces
    out, i, k = [], 0, 0
    while i < len(text):
        out.append(text[i:i + sizes[k % len(sizes)]])
        i, k = i + sizes[k % len(sizes)], k + 1
    return out


def test_at_least_the_parsers_the_models_need_are_registered():
    assert len(REASONING_PARSERS) >= 10
    assert set(REASONING_PARSERS) == set(CASES) | set(ALIASES)


@pytest.mark.parametrize("name, i, case", PARAMS, ids=IDS)
def test_whole_text(name, i, case):
    text, kwargs, reasoning, content = case
    parser = parser_of(name)
    assert parser.split(text, thinking=parser.thinking(kwargs)) == (reasoning, content)


@pytest.mark.parametrize("name, i, case", PARAMS, ids=IDS)
@pytest.mark.parametrize("sizes", ["tokens", [1], [3, 1, 4, 1, 5, 9], [8]])
def test_streamed_deltas_add_up_to_the_whole(name, i, case, sizes):
    text, kwargs, reasoning, content = case
    parser = parser_of(name)
    stream = parser.stream(thinking=parser.thinking(kwargs))
    got_r = got_c = ""
    pieces = _split(text, sizes)
    for k, piece in enumerate(pieces):
        r, c = stream.feed(piece, k == len(pieces) - 1)
        got_r, got_c = got_r + r, got_c + c
    assert (got_r, got_c) == (reasoning or "", content or "")


def test_thinking_switches():
    qwen3, v3, r1 = parser_of("qwen3"), parser_of("deepseek_v3"), parser_of("deepseek_r1")
    assert qwen3.thinking(None) and not qwen3.thinking(OFF)
    assert not v3.thinking(None) and v3.thinking(ON) and not v3.thinking({"thinking": False})
    assert r1.thinking(OFF)  # no switch


def test_engine_side_single_token_markers():
    r1, v3, mistral = parser_of("deepseek_r1"), parser_of("deepseek_v3"), parser_of("mistral")
    assert r1.is_reasoning_end([5, 1, 6, 2]) and not r1.is_reasoning_end([2, 1, 6])
    assert not r1.is_reasoning_end([5, 6])  # no tag: the model thinks first
    assert v3.is_reasoning_end([5, 6]) and not v3.is_reasoning_end([5, 1])
    assert mistral.is_reasoning_end([5, 6])  # thinks only when it opens [THINK]
    assert r1.ends_reasoning(2) and not r1.ends_reasoning(1)
    assert r1.reasoning_tokens([1, 7, 7, 2, 9], True) == 3


def test_engine_side_markers_of_several_tokens():
    parser = reasoning_parser_class("openai_gptoss")([(10, 11, 12)], [(10, 13, 12)])
    assert not parser.ends_reasoning(12, [10, 11, 12])
    assert parser.ends_reasoning(12, [4, 10, 13, 12])
    assert not parser.ends_reasoning(13, [4, 10, 13])
    # a prompt has ended the reasoning only when it ends with the final channel's header
    assert parser.is_reasoning_end([7, 10, 13, 12])
    assert not parser.is_reasoning_end([10, 13, 12, 5, 6, 7])
    assert parser.reasoning_tokens([10, 11, 12, 5, 5, 10, 13, 12, 9], True) == 5
    granite = reasoning_parser_class("granite")([(3, 4)], [(5, 6, 7)])
    assert granite.is_reasoning_end([3, 4, 8, 5, 6, 7]) and not granite.is_reasoning_end([3, 4])


def test_make_reads_the_markers_from_the_tokenizer():
    import copy

    import tiny

    tok = copy.deepcopy(tiny.tokenizer())
    tok.add_tokens(["<seed:think>", "</seed:think>"])
    seed = make_reasoning_parser("seed_oss", tok)
    assert (seed.start_token_id, seed.end_token_id) == tuple(
        tok.convert_tokens_to_ids(["<seed:think>", "</seed:think>"]))
    granite = make_reasoning_parser("granite", tok)  # phrases: their encodings
    assert granite.end_ids[0] == tuple(tok.encode("Here is my response:",
                                                  add_special_tokens=False))
    with pytest.raises(ValueError, match="no <think> or </think> token"):
        make_reasoning_parser("glm45", tok)
    tok.add_tokens(["<think>", "</think>"])
    glm47 = make_reasoning_parser("glm47", tok)  # an alias answers to its own name
    assert glm47.name == "glm47" and glm47.thinking(OFF) is False


def test_harmony_and_mistral_keep_special_tokens_in_the_text():
    assert parser_of("openai_gptoss").skip_special_tokens is False
    assert parser_of("mistral").skip_special_tokens is False
    assert parser_of("qwen3").skip_special_tokens is True
