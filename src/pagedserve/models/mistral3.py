"""Mistral 3 (`Mistral3ForConditionalGeneration`): Mistral Small 3.1 / 3.2, Magistral Small,
Ministral 3 and Devstral Small 2 checkpoints, served text-only.

The checkpoint is a Pixtral vision tower and a projector (skipped) around a text decoder whose
`text_config.model_type` names it: "mistral" (`models.llama.MistralForCausalLM`) or "ministral3"
(`models.ministral3`). llama.cpp writes the text decoder as architecture "mistral3".
"""

from __future__ import annotations

from typing import Any

from pagedserve.models.llama import MistralForCausalLM
from pagedserve.models.ministral3 import Ministral3ForCausalLM
from pagedserve.models.multimodal_text import TextOfMultimodal, text_config_of


class Mistral3ForConditionalGeneration(TextOfMultimodal, MistralForCausalLM):
    """The text decoder of a Mistral 3 checkpoint whose text model is Mistral's."""

    @staticmethod
    def for_config(config: Any) -> type:
        """The class for `config`'s text decoder; ValueError naming a text model type we do not
        serve."""
        model_type = getattr(text_config_of(config), "model_type", None)
        if model_type not in _TEXT_CLASSES:
            raise ValueError(f"Mistral3ForConditionalGeneration: unsupported text_config.model_type "
                             f"{model_type!r}; supported: {', '.join(_TEXT_CLASSES)}")
        return _TEXT_CLASSES[model_type]


class Mistral3Ministral3ForConditionalGeneration(TextOfMultimodal, Ministral3ForCausalLM):
    """The text decoder of a Mistral 3 checkpoint whose text model is Ministral 3's."""


_TEXT_CLASSES = {"mistral": Mistral3ForConditionalGeneration,
                 "ministral3": Mistral3Ministral3ForConditionalGeneration}
