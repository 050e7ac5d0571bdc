"""Seeded ShareGPT-like request traces: prompts cut from real text, lognormal lengths.

The text is English prose that every Python installation carries (the standard library's
docstrings), so traces need no download and are the same on every machine with the same Python.
"""

from __future__ import annotations

import importlib
import inspect
import math
import random
from dataclasses import dataclass

_CORPUS_MODULES = (
    "argparse", "asyncio", "collections", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email", "enum", "fractions", "functools", "heapq", "http.client",
    "inspect", "itertools", "json", "logging", "pathlib", "pickle", "random", "re", "shutil",
    "socket", "statistics", "string", "subprocess", "tarfile", "textwrap", "threading",
    "unittest", "urllib.parse", "zipfile",
)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: its prompt tokens and how many tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int


def corpus_text() -> str:
    """Docstrings of a fixed list of standard-library modules, in a fixed order."""
    parts = []
    for name in _CORPUS_MODULES:
        module = importlib.import_module(name)
        if module.__doc__:
            parts.append(inspect.cleandoc(module.__doc__))
        for _, obj in sorted(vars(module).items()):
            doc = getattr(obj, "__doc__", None)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and isinstance(doc, str):
                if getattr(obj, "__module__", None) == module.__name__:
                    parts.append(inspect.cleandoc(doc))
    return "\n\n".join(parts)


def lognormal_lengths(rng: random.Random, n: int, mean: float, sigma: float, lo: int, hi: int):
    """`n` integer lengths from a lognormal with the given mean, clipped to [lo, hi]."""
    mu = math.log(mean) - sigma**2 / 2
    return [max(lo, min(hi, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def sharegpt_like_trace(
    tokenizer,
    num_prompts: int,
    *,
    input_len_mean: float = 161.0,
    output_len_mean: float = 128.0,
    output_len_fixed: int | None = None,
    seed: int = 0,
    max_input_len: int = 1024,
    max_output_len: int = 1024,
) -> list[TraceRequest]:
    """Seeded requests: prompt lengths lognormal (sigma 0.8, the given mean), cut from the corpus
    at random offsets; output lengths lognormal (sigma 1, the given mean) or fixed."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    corpus = tokenizer(corpus_text(), add_special_tokens=False).input_ids
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    in_lens = lognormal_lengths(rng, num_prompts, input_len_mean, 0.8, 4, max_input_len)
    if output_len_fixed is not None:
        out_lens = [output_len_fixed] * num_prompts
    else:
        out_lens = lognormal_lengths(rng, num_prompts, output_len_mean, 1.0, 1, max_output_len)
    trace = []
    for n_in, n_out in zip(in_lens, out_lens):
        start = rng.randrange(0, len(corpus) - n_in)
        trace.append(TraceRequest(bos + corpus[start : start + n_in - len(bos)], n_out))
    return trace


COPY_INSTRUCTIONS = (
    ("Here is a passage:\n\n", "\n\nWrite the passage above again, exactly as it is."),
    ("Here is a text:\n\n", "\n\nWrite the text above again, exactly as it is."),
)


def copy_trace(
    tokenizer,
    num_prompts: int,
    *,
    input_len_mean: float = 96.0,
    seed: int = 0,
    max_input_len: int = 512,
    chat: bool = True,
) -> list[TraceRequest]:
    """A copy-heavy trace (editing, quoting, RAG answers): each prompt gives a passage cut from the
    corpus and asks the model to write it again (lengths lognormal, sigma 0.5, the given mean, in tokens), in the
    model's chat format when it has one; each output is as long as the passage plus 8 tokens, so
    an answer that quotes its prompt fills most of it."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = random.Random(seed)
    corpus = tokenizer(corpus_text(), add_special_tokens=False).input_ids
    lens = lognormal_lengths(rng, num_prompts, input_len_mean, 0.5, 8, max_input_len)
    trace = []
    for n in lens:
        start = rng.randrange(0, len(corpus) - n)
        passage = tokenizer.decode(corpus[start : start + n])
        before, after = rng.choice(COPY_INSTRUCTIONS)
        text = before + passage + after
        if chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
                ids = ids["input_ids"]
        elif chat and "<start_of_turn>" in tokenizer.get_vocab():  # Gemma's turns (the server's
            # default rendering for a Gemma tokenizer without a template, as the embedded one)
            ids = tokenizer(f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
                            ).input_ids
        else:
            ids = tokenizer(text + "\n\n").input_ids
        trace.append(TraceRequest(list(ids), n + 8))
    return trace
