"""Incremental detokenization, stop-string matching and per-token strings for logprobs.

`IncrementalDetokenizer` turns generated token ids into text deltas as they arrive. Each step
decodes only a small window of tokens (vLLM's prefix/read offsets): the text of the window
``tokens[prefix:]`` minus the text of ``tokens[prefix:read]`` is the new text. Decoding a few
tokens before the new ones matters for two reasons:

* SentencePiece-style decoders (Metaspace, or Replace + Strip) drop the leading space of the
  *first* token they decode; with a prefix in front, the new token is not first, so its space
  is kept ("Hello" + "▁world" gives " world", not "world").
* Byte-fallback (``<0xE4>``) and byte-level BPE tokens can split one UTF-8 character over
  several tokens. A partial character decodes to U+FFFD; while the new text ends with U+FFFD
  we hold it back and keep the window open, so the character is emitted once, complete.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "IncrementalDetokenizer",
    "TokenizerInfo",
    "decode_token",
    "find_stop",
    "special_token_ids",
]

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded in front of the first output tokens (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET; bigger is more conservative).
INITIAL_PREFIX_TOKENS = 5
# A UTF-8 character has at most 3 continuation bytes, so at most 3 tokens to step back.
_MAX_CONTINUATION_TOKENS = 3


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids that ``skip_special_tokens=True`` removes from decoded text.

    The union of ``tokenizer.all_special_ids`` (bos/eos/unk/pad/... and the extra special
    tokens) and, for a ``tokenizers``-backed tokenizer, every added token flagged special.
    NOTE: the second set matters: Gemma's ``<start_of_turn>``/``<end_of_turn>`` are special
    added tokens that ``tokenizer.decode(..., skip_special_tokens=True)`` drops, but they are
    not in ``all_special_ids``.
    """
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ()) if i is not None}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        ids.update(int(i) for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
    return ids


@dataclass(frozen=True)
class TokenizerInfo:
    """What the detokenizer needs to know about a tokenizer, computed once.

    Computing it walks the vocabulary and its added tokens (costly for a large one); build it
    once per tokenizer with `from_tokenizer` and pass it to every `IncrementalDetokenizer`.
    """

    vocab_size: int
    special_ids: frozenset[int]
    # True: decode token strings with convert_tokens_to_string alone (fast tokenizers, or
    # slow ones without added tokens). False: HF slow decoding, added tokens verbatim.
    plain_decode: bool
    added_tokens: frozenset[str]
    special_tokens: frozenset[str]
    # The text of one token string decoded alone (plain decoding), shared by the requests'
    # detokenizers: the decoding window of a step usually starts with one token. NOTE: a cache
    # of a pure function (a decoder maps a token list to one text), at most one entry per
    # token of the vocabulary.
    single_decodes: dict[str, str] = field(default_factory=dict, compare=False, hash=False,
                                           repr=False)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenizerInfo:
        """Inspect ``tokenizer`` (see `special_token_ids` for what counts as special)."""
        fast = bool(getattr(tokenizer, "is_fast", False))
        added: Any = ()
        if not fast and hasattr(tokenizer, "get_added_vocab"):
            added = tokenizer.get_added_vocab()
        return cls(
            vocab_size=len(tokenizer),
            special_ids=frozenset(special_token_ids(tokenizer)),
            plain_decode=fast or not added,
            added_tokens=frozenset(added),
            special_tokens=frozenset(getattr(tokenizer, "all_special_tokens", ())),
        )


class IncrementalDetokenizer:
    """Decodes one output sequence incrementally, in O(new tokens) per step.

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow).
        prompt_token_ids: the prompt; only its last few tokens are used, as decoding context.
        skip_special_tokens: leave special tokens (see `special_token_ids`) out of the text.
        spaces_between_special_tokens: for slow tokenizers with added tokens, join the added
            tokens and the text around them with spaces (as HF's slow ``decode`` and vLLM
            do). Fast tokenizers ignore it, as in vLLM.
        tokenizer_info: ``TokenizerInfo.from_tokenizer(tokenizer)``, shared between
            requests; computed here when not given (milliseconds for big vocabularies).

    The concatenation of the deltas returned by `append` is `text`. For output tokens that
    spell valid UTF-8 it equals ``decode(prompt + output)`` minus ``decode(prompt)`` (without
    ``clean_up_tokenization_spaces``), and no delta contains U+FFFD. Text is held back only
    while it ends with U+FFFD (a character still being spelled out in bytes). Invalid byte
    sequences (a model emitting broken UTF-8) come out as U+FFFD once text after them
    arrives, or on `flush`. A character split between the end of the prompt and the output
    counts as prompt text and is not emitted (as in vLLM).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        *,
        tokenizer_info: TokenizerInfo | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        info = tokenizer_info if tokenizer_info is not None else TokenizerInfo.from_tokenizer(
            tokenizer
        )
        self._info = info
        self._skip_ids = info.special_ids if skip_special_tokens else frozenset()
        # NOTE (step cost): for a transformers fast tokenizer, its `tokenizers` backend's own
        # calls (what its convert_ids_to_tokens / convert_tokens_to_string run), without the
        # Python wrappers: one token a step pays for them twice (measured: 2.5 us -> 0.9 us).
        self._id_to_token, self._decode_plain = _fast_backend(tokenizer) or (None, None)
        if not info.plain_decode:  # (HF slow decoding of added tokens: see _decode)
            self._decode_plain = None

        self._output_token_ids: list[int] = []
        self._text = ""
        # The decoding window: token strings, starting at the prefix offset (earlier tokens
        # are dropped). tokens[:_read] were emitted; _emitted counts characters of
        # decode(tokens) beyond decode(tokens[:_read]) that were emitted too (the safe part
        # of a held-back tail).
        self._tokens: list[str] = self._prompt_window(prompt_token_ids)
        self._read = len(self._tokens)
        self._emitted = 0

    # ------------------------------------------------------------------ public API

    @property
    def text(self) -> str:
        """The output text so far (the concatenation of all deltas)."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        """All output token ids appended so far, special ones included.

        NOTE: this is the internal list (no copy, O(1)); do not mutate it.
        """
        return self._output_token_ids

    def append(self, new_token_ids: Iterable[int] | int) -> str:
        """Add newly generated token ids; return the text they complete (maybe "")."""
        if type(new_token_ids) is int:  # the engine's one token a step: no ABC check, no copy
            self._output_token_ids.append(new_token_ids)
            # (`_to_tokens([id])` for one id, inlined: once per token)
            if (not 0 <= new_token_ids < self._info.vocab_size
                    or new_token_ids in self._skip_ids):
                return ""
            to_token = self._id_to_token
            token = (to_token(new_token_ids) if to_token is not None
                     else self.tokenizer.convert_ids_to_tokens([new_token_ids])[0])
            if not token:
                return ""
            self._tokens.append(token)
            return self._step(final=False)
        if isinstance(new_token_ids, numbers.Integral):
            new_token_ids = [new_token_ids]
        ids = [int(i) for i in new_token_ids]
        if not ids:
            return ""
        self._output_token_ids.extend(ids)
        tokens = self._to_tokens(ids)
        if not tokens:
            return ""
        self._tokens.extend(tokens)
        return self._step(final=False)

    def flush(self) -> str:
        """Emit the held-back tail, e.g. when the request finishes.

        Text is held back while it ends with U+FFFD (a character that may still be
        completed). After `flush`, `text` equals the full decoding, with U+FFFD for an
        incomplete trailing character. vLLM never emits that tail; call this only if the
        final text should include it.
        """
        return self._step(final=True)

    # ------------------------------------------------------------------ internals

    def _step(self, final: bool) -> str:
        tokens, read = self._tokens, self._read
        if read == 1 and self._info.plain_decode:  # (the common window: one token, then new)
            memo = self._info.single_decodes
            prefix_text = memo.get(tokens[0])
            if prefix_text is None:
                prefix_text = memo[tokens[0]] = self._decode(tokens[:1])
        else:
            prefix_text = self._decode(tokens[:read])
        plain = self._decode_plain
        full_text = plain(tokens) if plain is not None and tokens else self._decode(tokens)
        # NOTE: slice by length, not by matching prefix_text: decoders are not always
        # prefix-stable (ByteFallback turns a whole byte group into U+FFFD once it turns
        # invalid, e.g. "A" + <0xE4> decodes to "\ufffd\ufffd"). Slicing by length never
        # emits a character position twice, so nothing is duplicated in such cases.
        if len(full_text) <= len(prefix_text):
            return ""
        pending = full_text[len(prefix_text) :]
        if not final and pending.endswith(REPLACEMENT_CHAR):
            # A trailing U+FFFD may be a character still being spelled out byte by byte.
            # Emit what precedes it; keep the window open (read offset unchanged).
            # NOTE: the window then grows until the character completes; a model emitting
            # an endless run of invalid bytes makes steps O(run length), as in vLLM.
            safe = len(pending.rstrip(REPLACEMENT_CHAR))
            if safe <= self._emitted:
                return ""
            delta = pending[self._emitted : safe]
            self._emitted = safe
        else:
            delta = pending[self._emitted :]
            # Advance: the new prefix starts at the old read offset; drop what precedes it.
            del tokens[:read]
            self._read = len(tokens)
            self._emitted = 0
        self._text += delta
        return delta

    def _prompt_window(self, prompt_token_ids: Sequence[int]) -> list[str]:
        """The last few prompt tokens, starting on a character boundary if possible."""
        # +2 in case some are skipped special tokens (as vLLM), + up to 3 continuation bytes.
        extra = 2 + _MAX_CONTINUATION_TOKENS
        tokens = self._to_tokens(list(prompt_token_ids[-(INITIAL_PREFIX_TOKENS + extra) :]))
        start = max(0, len(tokens) - INITIAL_PREFIX_TOKENS)
        # NOTE: a window that starts inside a multi-byte character decodes to U+FFFD there,
        # and under ByteFallback the whole byte group stays U+FFFD while the output
        # continues it (a prompt "日日" spelled in byte tokens, then output byte tokens),
        # which would hold the output back forever. Step back (at most 3 tokens: a
        # character has at most 3 continuation bytes) until the window decodes cleanly.
        # If the prompt itself ends mid-character or holds U+FFFD, nothing helps; stop.
        lowest = max(0, start - _MAX_CONTINUATION_TOKENS)
        while start > lowest and REPLACEMENT_CHAR in self._decode(tokens[start:]):
            start -= 1
        return tokens[start:]

    def _to_tokens(self, ids: list[int]) -> list[str]:
        """Token strings for ids, without skipped specials and ids the tokenizer lacks."""
        keep = [i for i in ids if 0 <= i < self._info.vocab_size and i not in self._skip_ids]
        if not keep:
            return []
        # NOTE: out-of-range ids (a model's padded vocab is often larger than the
        # tokenizer's) and vocab holes are dropped, as tokenizers' own decode drops them.
        # Dropping rather than mapping them to "" keeps every window token non-empty.
        if self._id_to_token is not None:
            tokens = [self._id_to_token(i) for i in keep]
        else:
            tokens = self.tokenizer.convert_ids_to_tokens(keep)
        return [t for t in tokens if t]

    def _decode(self, tokens: list[str]) -> str:
        if not tokens:
            return ""
        if self._info.plain_decode:
            if self._decode_plain is not None:
                return self._decode_plain(tokens)
            return self.tokenizer.convert_tokens_to_string(tokens)
        return _convert_tokens_to_string_with_added(
            self.tokenizer,
            tokens,
            self._info.added_tokens,
            self._info.special_tokens if self.skip_special_tokens else frozenset(),
            self.spaces_between_special_tokens,
        )


def _fast_backend(tokenizer: Any) -> tuple[Any, Any] | None:
    """(id_to_token, decode) of the `tokenizers` backend of a transformers fast tokenizer whose
    `convert_ids_to_tokens` / `convert_tokens_to_string` are the library's own (they call exactly
    these: `backend.id_to_token(i)` per id, `backend.decoder.decode(tokens)` or, without a decoder,
    `" ".join(tokens)`); None for any other tokenizer (a subclass overriding them, a wrapper).

    NOTE: the decoder is taken once, when a request's detokenizer is built: a tokenizer whose
    decoder is replaced afterwards changes the text of later requests only.
    """
    transformers = sys.modules.get("transformers")  # never imported here: a tokenizer of it is
    fast_cls = getattr(transformers, "PreTrainedTokenizerFast", None)
    cls = type(tokenizer)
    if (fast_cls is None or not isinstance(tokenizer, fast_cls)
            or cls.convert_ids_to_tokens is not fast_cls.convert_ids_to_tokens
            or cls.convert_tokens_to_string is not fast_cls.convert_tokens_to_string):
        return None
    backend = tokenizer.backend_tokenizer
    decoder = backend.decoder
    return backend.id_to_token, (decoder.decode if decoder is not None else " ".join)


def _convert_tokens_to_string_with_added(
    tokenizer: Any,
    tokens: list[str],
    added_vocab: frozenset[str],
    skip: frozenset[str],
    spaces_between_special_tokens: bool,
) -> str:
    """HF slow-tokenizer decoding: added tokens verbatim, runs between them via the model."""
    parts: list[str] = []
    run: list[str] = []
    for token in tokens:
        if token in skip:
            continue
        if token in added_vocab:
            if run:
                parts.append(tokenizer.convert_tokens_to_string(run))
                run = []
            parts.append(token)
        else:
            run.append(token)
    if run:
        parts.append(tokenizer.convert_tokens_to_string(run))
    return (" " if spaces_between_special_tokens else "").join(parts)


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The string shown for one token in logprobs (``Logprob.decoded_token``).

    ``convert_tokens_to_string([convert_ids_to_tokens(token_id)])``, as vLLM shows it: the
    token decoded on its own, so a byte-fallback or partial byte-level token is U+FFFD, and
    decoders that strip the first token's leading space (Llama's Strip, Metaspace) strip it
    here too. An id the tokenizer does not know gives "".
    """
    token_id = int(token_id)
    if token_id < 0:
        return ""
    # NOTE: no len(tokenizer) bound check: `len` walks the added tokens of a big vocabulary and
    # this runs for every logprob. Fast tokenizers map unknown ids to None; slow ones may raise.
    try:
        token = tokenizer.convert_ids_to_tokens(token_id)
    except (IndexError, KeyError, OverflowError):
        return ""
    if not token:
        return ""
    return tokenizer.convert_tokens_to_string([token])


def find_stop(
    text: str,
    new_text_len: int,
    stop: Sequence[str],
    include_stop_str_in_output: bool,
) -> tuple[int | None, str | None]:
    """Find a stop string that ends in the last ``new_text_len`` characters of ``text``.

    Returns ``(cut, matched)``: the output text is ``text[:cut]``, which ends just before
    the stop string, or just after it when ``include_stop_str_in_output``. ``(None, None)``
    when nothing matched.

    Only the region where a new match can end is searched: the new text plus the
    ``len(s) - 1`` characters before it (earlier text was checked on earlier calls).

    NOTE: when several stop strings match, the one that *ends* first wins (ties: the one
    that starts first, i.e. the longer one). That is the stop a one-character-at-a-time
    stream would hit first, so the result does not depend on how the text was chunked into
    tokens. (vLLM returns the first match in ``stop``'s order, which does.)
    """
    if not stop or new_text_len <= 0:
        return None, None
    new_start = max(0, len(text) - new_text_len)
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        if not s:
            raise ValueError("stop cannot contain an empty string")
        start = text.find(s, max(0, new_start - len(s) + 1))
        if start == -1:
            continue
        candidate = (start + len(s), start, s)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return None, None
    end, start, matched = best
    return (end if include_stop_str_in_output else start), matched
