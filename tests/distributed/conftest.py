import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tiny  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Build tiny checkpoints lazily, once per architecture per session."""
    cache = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = tiny.make_checkpoint(tmp_path_factory.mktemp(arch), arch)
        return cache[arch]

    return get
