"""The text decoder of a multimodal checkpoint, served text-only.

Multimodal checkpoints (Gemma 3, Mistral 3 / Ministral 3, ...) hold a text decoder that is one of
our families, under a prefix (`model.language_model.` in transformers 5, `language_model.model.`
before), next to a vision tower and a projector. `TextOfMultimodal` loads the decoder from them:
the text config builds the model, the prefix is renamed away and the vision weights are skipped.
Inputs are text only (as vLLM with `--limit-mm-per-prompt '{"image": 0}'`).
"""

from __future__ import annotations

import copy
from typing import Any

from pagedserve.distributed.tp import SINGLE, TPContext


def text_config_of(config: Any) -> Any:
    """The text decoder's config of a multimodal config (`get_text_config()` / `text_config`)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config.text_config


class TextOfMultimodal:
    """Mixin before a `PagedCausalLM` family class: builds it from the multimodal config's text
    config and maps the checkpoint's names onto it. `self.config` stays the whole config."""

    _RENAMES = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("language_model.", "model."),
    )
    # NOTE: every non-text module of the checkpoints we load must be listed, or loading stops at
    # its first weight ("unexpected weight"), which is the safe failure.
    _SKIP = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
             "multi_modal_projector.")

    def __init__(self, config: Any, *, tp: TPContext = SINGLE):
        text = text_config_of(config)
        if hasattr(config, "tie_word_embeddings"):
            # NOTE: HF ties the LM head by the *multimodal* config's flag (the model reads its
            # own config), whatever the text config says: Mistral 3's defaults differ.
            text = copy.copy(text)
            text.tie_word_embeddings = bool(config.tie_word_embeddings)
        if getattr(config, "enable_expert_parallel", False):  # (the executor sets it on the
            text = copy.copy(text)  # outer config: an MoE text decoder reads its own)
            text.enable_expert_parallel = True
        super().__init__(text, tp=tp, **self._text_kwargs(config))
        self.config = config

    def _text_kwargs(self, config: Any) -> dict:
        """Keyword arguments of the text class beyond its config (none by default; Gemma 3n's
        image / audio token embedders), from the whole multimodal config."""
        return {}

    def _rename(self, name: str) -> str | None:
        if name.startswith(self._SKIP):
            return None
        for old, new in self._RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        return super()._rename(name)
