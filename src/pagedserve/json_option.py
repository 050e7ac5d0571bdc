"""One option parser shared by the option dataclasses (config.py, pooling_params.py): a JSON
object given as a dict or as a string. Pure Python, imports nothing of pagedserve."""

from __future__ import annotations

import json
from typing import Any


def json_object(name: str, value: Any) -> dict[str, Any]:
    """A dict, or a string holding a JSON object, as a dict; ValueError naming `name` else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} must be a JSON object, got {value!r}: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object (a dict), got {value!r}")
    return value
