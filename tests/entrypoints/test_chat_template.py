"""Chat prompt rendering: the tokenizer's template, the documented defaults (Gemma's turn format
with `<end_of_turn>` as a stop token; a plain format otherwise), and errors as ValueError."""

import pytest

import tiny
from pagedserve.engine.chat_template import (
    default_chat_format,
    flatten_content,
    render_chat,
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Capital of France?"},
]


@pytest.fixture(scope="module")
def gemma_like():
    tok = tiny.tokenizer().__class__(tokenizer_object=tiny.tokenizer().backend_tokenizer,
                                     bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    return tok


def test_gemma_vocabulary_without_template_gets_gemma_turns_and_end_of_turn_stop(gemma_like):
    fmt = default_chat_format(gemma_like)
    assert fmt.name == "gemma-default"
    assert fmt.stop_token_ids == [gemma_like.convert_tokens_to_ids("<end_of_turn>")]
    text = render_chat(gemma_like, MESSAGES, fmt)
    assert text == (
        "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nCapital of France?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ids = gemma_like(text, add_special_tokens=False).input_ids
    assert ids.count(gemma_like.convert_tokens_to_ids("<start_of_turn>")) == 4


def test_other_vocabulary_without_template_gets_the_plain_format():
    tok = tiny.tokenizer()
    fmt = default_chat_format(tok)
    assert fmt.name == "plain-default" and fmt.stop_token_ids == []
    assert render_chat(tok, MESSAGES[1:2], fmt) == "<s>User: Hi\n\nAssistant:"


def test_tokenizer_template_wins_and_continue_final_message_leaves_the_turn_open():
    tok = tiny.tokenizer().__class__(tokenizer_object=tiny.tokenizer().backend_tokenizer,
                                     bos_token="<s>", eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}[/]"
                         "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    fmt = default_chat_format(tok)
    assert fmt.name == "tokenizer" and fmt.template is None
    assert render_chat(tok, MESSAGES[1:2], fmt) == "[user]Hi[/][assistant]"
    text = render_chat(tok, MESSAGES[1:3], fmt, add_generation_prompt=False,
                       continue_final_message=True)
    assert text == "[user]Hi[/][assistant]Hello!"


def test_template_errors_and_bad_content_are_value_errors():
    tok = tiny.tokenizer()
    fmt = default_chat_format(tok)
    with pytest.raises(ValueError, match="messages"):
        render_chat(tok, [], fmt)
    with pytest.raises(ValueError, match="chat template"):
        render_chat(tok, MESSAGES, fmt, chat_template="{{ raise_exception('no system') }}")
    with pytest.raises(ValueError, match="image_url"):
        flatten_content([{"type": "image_url", "image_url": {"url": "x"}}], 0)
    assert flatten_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                           0) == "a\nb"
