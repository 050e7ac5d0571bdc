"""A sequence's block table and the chained block hashes of prefix caching. Pure Python.

(Shared by the block manager, core/kv_cache_manager.py, and its prefix cache,
core/prefix_cache.py.)
"""

from __future__ import annotations

from dataclasses import dataclass, field


def salt_root(salt: str | tuple | None) -> int:
    """The parent hash of a chain's first block: 0 unsalted, else derived from the salt (a
    request's cache_salt, or (cache_salt, LoRA adapter id) for a request with an adapter:
    requests of different adapters never share KV)."""
    return 0 if salt is None else hash(("cache_salt", salt))


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The prefix-cache hash of a full block: chained over its parent's hash and its tokens."""
    return hash((parent, tokens))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class BlockTable:
    """Logical-to-physical block map of one sequence, with the number of reserved token slots
    (a row of `width` blocks per logical block: see the module docstring)."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # Chained hashes of the leading full, computed blocks (prefix caching), one per block
    # (None for a leading block whose hash is not known: only the last one is read).
    hashes: list[int] = field(default_factory=list)
    # Per sliding-window group: its leading logical blocks given back (null entries); None
    # when the model has no sliding-window group.
    low: list[int] | None = None
    # The workers' copy (core/step_delta.py): its leading entries that are still these, and its
    # length. NOTE: every change of an entry below the end, or cut of the list, lowers `synced`
    # to the first entry it changed (`changed_from`); appending changes neither.
    synced: int = 0
    sent_len: int = 0

    def changed_from(self, index: int) -> None:
        """Entries from `index` on no longer match the workers' copy."""
        if index < self.synced:
            self.synced = index
