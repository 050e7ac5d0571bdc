"""The n-gram proposer (vLLM's "ngram", prompt lookup): the tokens that followed the latest
earlier occurrence of the sequence's last n tokens, for n from `prompt_lookup_max` down to
`prompt_lookup_min`. Pure Python, stateless."""

from __future__ import annotations

from array import array
from typing import Any

from pagedserve.core.proposers.base import DraftRow, Proposer


def ngram_propose(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the last n tokens of
    `tokens`, for the longest n in `max_n .. min_n` that occurs earlier; [] when none does.

    The search runs on the tokens' bytes (`bytes.rfind`, in C): a hit must start on a token
    boundary, else the search goes on to the left."""
    num = len(tokens)
    if num < min_n + 1 or k < 1:
        return []
    data = array("i", tokens).tobytes()
    width = array("i").itemsize
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        pattern = data[(num - n) * width:]
        # The suffix itself is the occurrence at num - n: look strictly before it.
        end = (num - 1) * width
        while True:
            pos = data.rfind(pattern, 0, end)
            if pos < 0:
                break
            if pos % width == 0:
                first = pos // width + n
                return tokens[first : first + k]
            end = pos + len(pattern) - 1
    return []


class NgramProposer(Proposer):
    """Prompt lookup over each sequence's own tokens (see the module docstring)."""

    name = "ngram"

    @classmethod
    def check_config(cls, config: Any) -> None:
        if config.model:
            raise ValueError(f"speculative_config.model: the ngram method takes no model, got "
                             f"{config.model!r}")

    def propose(self, batch: list[DraftRow]) -> list[list[int]]:
        hi, lo = self.config.prompt_lookup_max, self.config.prompt_lookup_min
        return [ngram_propose(seq.token_ids, limit, hi, lo) for seq, limit in batch]
