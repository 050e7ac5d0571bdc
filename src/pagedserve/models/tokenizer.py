"""Loading a Hugging Face tokenizer, and finding the token ids that end generation.

We never execute model-provided code: ``trust_remote_code`` is False unless the caller asks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["load_tokenizer", "eos_token_ids", "bad_words_token_ids"]


def load_tokenizer(
    path_or_name: str | os.PathLike[str],
    *,
    trust_remote_code: bool = False,
    gguf_file: str | None = None,
    **kwargs: Any,
):
    """Load a (fast) tokenizer with ``transformers.AutoTokenizer``.

    Args:
        path_or_name: a local model folder, a Hub name, or the path of a ``.gguf`` file
            (then the folder and ``gguf_file`` are split out of it).
        trust_remote_code: allow the repository's own tokenizer code to run. Off by
            default: we never execute model-provided code unless told to.
        gguf_file: the GGUF file's name inside ``path_or_name`` to read the tokenizer from.
        **kwargs: passed on to ``AutoTokenizer.from_pretrained`` (e.g. ``revision``).

    Raises:
        ValueError: ``path_or_name`` is empty, or names a ``.gguf`` file while ``gguf_file``
            is given too.
    """
    from transformers import AutoTokenizer  # heavy import, only when loading

    path = os.fspath(path_or_name)
    if not path:
        raise ValueError("path_or_name must be a model folder, a Hub name or a .gguf file")
    if path.endswith(".gguf") and os.path.isfile(path):
        if gguf_file is not None:
            raise ValueError(
                f"gguf_file={gguf_file!r} given, but path_or_name is already a .gguf file: {path}"
            )
        path, gguf_file = os.path.split(os.path.abspath(path))
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    return drop_construction_copies(
        AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs))


# Attributes in which some transformers tokenizer classes (Gemma's, Llama's, ...) keep the Python
# vocabulary and merges they built their Rust tokenizer from; nothing reads them afterwards.
_CONSTRUCTION_COPIES = ("_vocab", "_merges")


def drop_construction_copies(tokenizer: Any) -> Any:
    """Release the Python copies of the vocabulary and merges a fast tokenizer keeps after building
    its Rust tokenizer (for Gemma 3's 262k tokens and 515k merges: ~130 MiB of Python objects that
    nothing reads again); returns `tokenizer`. NOTE: only once the Rust backend exists: a slow
    (pure Python) tokenizer still reads its vocabulary."""
    if getattr(tokenizer, "is_fast", False) and getattr(tokenizer, "_tokenizer", None) is not None:
        for name in _CONSTRUCTION_COPIES:
            if isinstance(getattr(tokenizer, name, None), (dict, list)):
                setattr(tokenizer, name, None)
    return tokenizer


def eos_token_ids(
    tokenizer: Any,
    config: Any = None,
    model_path: str | os.PathLike[str] | None = None,
) -> set[int]:
    """The token ids that end generation (the model's EOS set).

    Merges, ignoring ``None`` and negative ids:

    * ``tokenizer.eos_token_id``;
    * ``config.eos_token_id`` (a ``PretrainedConfig``, any object with that attribute, or a
      dict), which may be an int or a list of ints (Llama 3, Gemma 3 list several);
    * ``eos_token_id`` of ``generation_config.json`` in ``model_path``, if that file exists.
      When ``model_path`` is None, the tokenizer's ``name_or_path`` is used if it is a
      local folder.

    Raises:
        ValueError: an ``eos_token_id`` entry is not an integer (a malformed config).
    """
    ids: set[int] = set()
    if tokenizer is not None:
        _add_ids(ids, getattr(tokenizer, "eos_token_id", None), "tokenizer.eos_token_id")
    if config is not None:
        if isinstance(config, Mapping):
            value = config.get("eos_token_id")
        else:
            value = getattr(config, "eos_token_id", None)
        _add_ids(ids, value, "config.eos_token_id")

    folder = model_path
    if folder is None and tokenizer is not None:
        name = getattr(tokenizer, "name_or_path", None)
        if isinstance(name, str) and name and os.path.isdir(name):
            folder = name
    if folder is not None:
        gen_path = Path(folder) / "generation_config.json"
        if gen_path.is_file():
            try:
                gen = json.loads(gen_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read {gen_path}: {exc}") from exc
            if isinstance(gen, Mapping):
                _add_ids(ids, gen.get("eos_token_id"), f"eos_token_id in {gen_path}")
    return ids


def _add_ids(out: set[int], value: Any, what: str) -> None:
    if value is None:
        return
    values: Iterable[Any] = value if isinstance(value, (list, tuple, set)) else [value]
    for v in values:
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{what} must be an int or a list of ints, got {value!r}")
        if v >= 0:
            out.add(v)


def bad_words_token_ids(tokenizer: Any, words: Iterable[str]) -> list[list[int]]:
    """The token sequences of `bad_words`, as vLLM builds them: each word as written (left
    stripped), plus with a leading space when that tokenizes to as many tokens with another
    first token (mid-sentence spelling for BPE vocabularies)."""
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            continue
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out
