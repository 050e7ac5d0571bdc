"""The model's generation defaults (`generation_config.json`), as vLLM applies them.

`generation_config` (engine option / `--generation-config`):

- ``"auto"`` (default): the model's own ``generation_config.json`` (an HF folder; a folder
  without one: the generation fields of its ``config.json``; a GGUF file: none);
- ``"vllm"``: none, the neutral defaults of `SamplingParams`;
- a folder: the ``generation_config.json`` found there;

and `override_generation_config` (``--override-generation-config '{"temperature": 0.5}'``)
sets fields over whichever it is (over "vllm" too).

Of that config only the fields that differ from transformers' defaults count
(`GenerationConfig.to_diff_dict`, as vLLM's `ModelConfig.get_diff_sampling_param`), and of those
only ``repetition_penalty``, ``temperature``, ``top_k``, ``top_p``, ``min_p`` and
``max_new_tokens`` (which becomes ``max_tokens``). ``do_sample`` is not read (vLLM neither): a
config with ``do_sample: false`` and ``temperature: 0.6`` samples at 0.6.

Who uses them:

- `LLM.generate` / `LLM.chat` without `sampling_params`: ``SamplingParams(**defaults)``
  (`LLM.get_default_sampling_params`); an explicit `SamplingParams` is used as given.
- the server: a request field that is absent (or null) takes the default; a field the request
  sets wins. ``max_tokens`` defaults to the config's ``max_tokens`` when the request has none,
  capped by what the context leaves.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("pagedserve.engine")

# The generation fields vLLM takes from the config (HF names).
SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p",
                   "max_new_tokens")


def diff_sampling_params(source, generation_config: str = "auto",
                         override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The default sampling parameters `generation_config` gives for the model `source`
    (a `ModelSource`), with the fields of `override` set over them (vLLM's
    `--override-generation-config`, also over "vllm"): vLLM names (``max_tokens``), only those
    set."""
    if generation_config == "vllm":
        config = {}
    elif generation_config == "auto":
        config = None
        if getattr(source, "kind", None) == "hf":  # GGUF: its header carries none
            config = _read(Path(source.path), fallback=getattr(source, "config", None))
    else:
        folder = Path(generation_config).expanduser()
        if not folder.is_dir():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a "
                             f"generation_config.json, got {generation_config!r}")
        config = _read(folder, fallback=None)
        if config is None:
            raise ValueError(f"generation_config: no generation_config.json in {folder}")
    config = {**(config or {}), **(override or {})}
    values = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    if "max_new_tokens" in values:  # HF's max_new_tokens is vLLM's max_tokens
        values["max_tokens"] = values.pop("max_new_tokens")
    from pagedserve.sampling_params import SamplingParams

    try:  # NOTE: checked once here, so that a bad config fails at load, not every request
        SamplingParams(**values)
    except ValueError as e:
        raise ValueError(f"generation_config: the model's defaults {values} are invalid: {e}"
                         ) from e
    return values


def _read(folder: Path, fallback) -> dict[str, Any] | None:
    """`GenerationConfig.to_diff_dict()` of a folder's generation_config.json, else of the
    model config `fallback` (None without either)."""
    from transformers import GenerationConfig

    if (folder / "generation_config.json").is_file():
        try:
            return GenerationConfig.from_pretrained(str(folder)).to_diff_dict()
        except (OSError, ValueError) as e:
            raise ValueError(f"generation_config: cannot read {folder / 'generation_config.json'}"
                             f": {e}") from e
    if fallback is None:
        return None
    return GenerationConfig.from_model_config(fallback).to_diff_dict()


__all__ = ["SAMPLING_FIELDS", "diff_sampling_params"]
