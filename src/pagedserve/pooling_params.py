"""Pooling requests (vLLM's `PoolingParams`), the model's pooler configuration, and what one
pooling request asks the model runner for. Pure Python, no torch.

- `PoolingParams`: a request's options (`task`, `dimensions`, `normalize` / `use_activation`).
- `PoolerConfig`: how the served model pools: `pooling_type` (LAST, MEAN or CLS) and
  `normalize`. From `pooler_config` (the engine option), else the model's sentence-transformers
  files (`modules.json`, its Pooling module's `config.json`, a `Normalize` module), else vLLM's
  default for decoder models served as embedding models: LAST, normalized.
- `PoolingSpec`: one request's resolved pooling, carried by its rows to the runner.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pagedserve.json_option import json_object

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# vLLM's pooling tasks we serve: one vector per prompt, one per prompt token, class probabilities
# (`*ForSequenceClassification` checkpoints).
POOLING_TASKS = ("embed", "token_embed", "classify")
RUNNERS = ("auto", "generate", "pooling")

# sentence-transformers' Pooling config keys -> our pooling types (vLLM's parse_pooling_type).
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_KNOWN = (_ST_POOLING, _ST_NORMALIZE, "sentence_transformers.models.Transformer")


@dataclass
class PoolingParams:
    """A pooling request's options (vLLM's names).

    `task`: "embed" (one vector per prompt; the default), "token_embed" (one per prompt
    token) or "classify" (a classifier's class probabilities; its default). `dimensions`: keep the first `dimensions` values (Matryoshka models only).
    `normalize` (vLLM's older name) or `use_activation`: L2-normalize (default: the model's
    pooler configuration).
    """

    task: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS}, got {self.task!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {self.dimensions!r}")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a boolean, got {value!r}")

    def clone(self) -> PoolingParams:
        return PoolingParams(self.task, self.dimensions, self.normalize, self.use_activation)


@dataclass(frozen=True)
class PoolerConfig:
    """How the served model pools its final hidden states (see the module docstring)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    source: str = "default"  # where it came from: "default", "sentence-transformers", "option"

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got "
                             f"{self.pooling_type!r}")

    @classmethod
    def resolve(cls, option: str | dict | None, model_dir: str | None) -> PoolerConfig:
        """The option's settings over the sentence-transformers files' over the default."""
        base = sentence_transformers_pooling(model_dir) or cls()
        if not option:
            return base
        option = json_object("pooler_config", option)
        known = {"pooling_type", "seq_pooling_type", "normalize", "use_activation"}
        unknown = sorted(set(option) - known)
        if unknown:
            raise ValueError(f"pooler_config: unknown key(s) {unknown}; known: {sorted(known)}")
        kind = option.get("pooling_type", option.get("seq_pooling_type", base.pooling_type))
        norm = option.get("normalize", option.get("use_activation", base.normalize))
        if not isinstance(norm, bool):
            raise ValueError(f"pooler_config: normalize must be a boolean, got {norm!r}")
        return cls(str(kind).upper(), norm, "option")


def sentence_transformers_pooling(model_dir: str | None) -> PoolerConfig | None:
    """The pooling of a sentence-transformers folder (`modules.json`), as vLLM reads it: the
    Pooling module's mode (mean, CLS or last token; others keep LAST), normalized when a
    Normalize module follows. None without `modules.json`; ValueError for other modules (a
    Dense projection, ...), which we do not apply."""
    if model_dir is None:
        return None
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        modules: list[dict[str, Any]] = json.load(f)
    for m in modules:
        if m.get("type") not in _ST_KNOWN:
            raise ValueError(
                f"the model's sentence-transformers module {m.get('name')!r} ({m.get('type')}) "
                "is not supported (only Transformer, Pooling and Normalize): its embeddings "
                "would differ from sentence-transformers'")
    normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling is None:
        return None
    kind = "LAST"
    cfg_path = os.path.join(model_dir, pooling.get("path", ""), "config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            for key, value in json.load(f).items():
                if value is True and key in _ST_MODES:
                    kind = _ST_MODES[key]
    return PoolerConfig(kind, normalize, "sentence-transformers")


@dataclass(frozen=True)
class PoolingSpec:
    """One pooling request as the model runner sees it: `pooling_type` (LAST, MEAN, CLS, or ALL:
    every prompt token), then the first `dimensions` values kept, then L2 normalization; or,
    with `classify` set, the model's classifier head over the pooled state, then that activation
    ("softmax", "sigmoid" or "none")."""

    pooling_type: str
    normalize: bool
    dimensions: int | None = None
    classify: str | None = None

    @property
    def needs_whole_prompt(self) -> bool:
        """Whether every prompt position's hidden state is read (so none may come from the
        prefix cache): all but LAST."""
        return self.pooling_type != "LAST"
