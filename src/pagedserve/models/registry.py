"""Which of our model classes serves an HF checkpoint, by its config's `architectures`."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.models.apertus import ApertusForCausalLM
from pagedserve.models.apertus1p5 import Apertus1p5TextForCausalLM
from pagedserve.models.arcee import ArceeForCausalLM
from pagedserve.models.bamba import BambaForCausalLM
from pagedserve.models.bitnet import BitNetForCausalLM
from pagedserve.models.cohere import CohereForCausalLM
from pagedserve.models.cohere2 import Cohere2ForCausalLM
from pagedserve.models.dots1 import Dots1ForCausalLM
from pagedserve.models.falcon_h1 import FalconH1ForCausalLM
from pagedserve.models.gemma import GemmaForCausalLM
from pagedserve.models.gemma2 import Gemma2ForCausalLM
from pagedserve.models.exaone4 import Exaone4ForCausalLM
from pagedserve.models.exaone4_5 import Exaone4_5_ForConditionalGeneration
from pagedserve.models.cwm import CwmForCausalLM
from pagedserve.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pagedserve.models.ernie4_5 import Ernie4_5ForCausalLM
from pagedserve.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
from pagedserve.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from pagedserve.models.gemma3n import Gemma3nForCausalLM, Gemma3nForConditionalGeneration
from pagedserve.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from pagedserve.models.glm4 import Glm4ForCausalLM, GlmForCausalLM
from pagedserve.models.glm4_moe import Glm4MoeForCausalLM
from pagedserve.models.glm4_moe_lite import Glm4MoeLiteForCausalLM
from pagedserve.models.gpt2 import GPT2LMHeadModel
from pagedserve.models.hunyuan import HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM
from pagedserve.models.gpt_neox import GPTNeoXForCausalLM
from pagedserve.models.granite import GraniteForCausalLM
from pagedserve.models.helium import HeliumForCausalLM
from pagedserve.models.granite_moe import GraniteMoeForCausalLM, GraniteMoeSharedForCausalLM
from pagedserve.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM
from pagedserve.models.granite_swa import GraniteMoeSWAForCausalLM, GraniteSWAForCausalLM
from pagedserve.models.minicpm3 import MiniCPM3ForCausalLM
from pagedserve.models.laguna import LagunaForCausalLM
from pagedserve.models.hy_v3 import HYV3ForCausalLM
from pagedserve.models.gpt_bigcode import GPTBigCodeForCausalLM
from pagedserve.models.falcon import FalconForCausalLM
from pagedserve.models.mimo_v2_flash import MiMoV2FlashForCausalLM
from pagedserve.models.gpt_oss import GptOssForCausalLM
from pagedserve.models.jais2 import Jais2ForCausalLM
from pagedserve.models.jamba import JambaForCausalLM
from pagedserve.models.kimi_linear import KimiLinearForCausalLM
from pagedserve.models.mamba import FalconMambaForCausalLM, Mamba2ForCausalLM, MambaForCausalLM
from pagedserve.models.lfm2 import Lfm2ForCausalLM
from pagedserve.models.lfm2_moe import Lfm2MoeForCausalLM
from pagedserve.models.llama import LlamaForCausalLM, MinistralForCausalLM, MistralForCausalLM
from pagedserve.models.llama4 import Llama4ForCausalLM, Llama4ForConditionalGeneration
from pagedserve.models.ministral3 import Ministral3ForCausalLM
from pagedserve.models.minimax_m2 import MiniMaxM2ForCausalLM
from pagedserve.models.mistral3 import Mistral3ForConditionalGeneration
from pagedserve.models.mixtral import MixtralForCausalLM
from pagedserve.models.nemotron import NemotronForCausalLM
from pagedserve.models.nemotron_h import NemotronHForCausalLM
from pagedserve.models.olmo import OlmoForCausalLM
from pagedserve.models.olmoe import OlmoeForCausalLM
from pagedserve.models.olmo2 import Olmo2ForCausalLM
from pagedserve.models.olmo3 import Olmo3ForCausalLM
from pagedserve.models.opt import OPTForCausalLM
from pagedserve.models.phi import PhiForCausalLM
from pagedserve.models.phi3 import Phi3ForCausalLM
from pagedserve.models.phimoe import PhiMoEForCausalLM, PhimoeForCausalLM
from pagedserve.models.qwen2 import Qwen2ForCausalLM
from pagedserve.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedserve.models.qwen3 import Qwen3ForCausalLM
from pagedserve.models.qwen3_5 import (
    Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration)
from pagedserve.models.qwen3_moe import Qwen3MoeForCausalLM
from pagedserve.models.qwen3_next import Qwen3NextForCausalLM
from pagedserve.models.qwen_vl import (
    Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration, Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration)
from pagedserve.models.seed_oss import SeedOssForCausalLM
from pagedserve.models.smollm3 import SmolLM3ForCausalLM
from pagedserve.models.stablelm import StableLmForCausalLM
from pagedserve.models.starcoder2 import Starcoder2ForCausalLM
from pagedserve.models.afmoe import AfmoeForCausalLM
from pagedserve.models.exaone_moe import ExaoneMoEForCausalLM, ExaoneMoeForCausalLM
from pagedserve.models.solar_open import SolarOpenForCausalLM
from pagedserve.models.cohere2_moe import Cohere2MoeForCausalLM
from pagedserve.models.dbrx import DbrxForCausalLM
from pagedserve.models.vaultgemma import VaultGemmaForCausalLM
from pagedserve.models.youtu import YoutuForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MinistralForCausalLM": MinistralForCausalLM,
    "Ministral3ForCausalLM": Ministral3ForCausalLM,
    "Mistral3ForConditionalGeneration": Mistral3ForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Gemma3nForCausalLM": Gemma3nForCausalLM,
    "Gemma3nForConditionalGeneration": Gemma3nForConditionalGeneration,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    # mixture of experts (layers/moe.py)
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    # dense families of issue 35 (one file each)
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "PhiForCausalLM": PhiForCausalLM,
    "StableLmForCausalLM": StableLmForCausalLM,
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "ApertusForCausalLM": ApertusForCausalLM,
    "ArceeForCausalLM": ArceeForCausalLM,
    "HeliumForCausalLM": HeliumForCausalLM,
    "OlmoForCausalLM": OlmoForCausalLM,
    "NemotronForCausalLM": NemotronForCausalLM,
    "Jais2ForCausalLM": Jais2ForCausalLM,
    "CwmForCausalLM": CwmForCausalLM,
    "VaultGemmaForCausalLM": VaultGemmaForCausalLM,
    "YoutuForCausalLM": YoutuForCausalLM,
    "Apertus1p5TextForCausalLM": Apertus1p5TextForCausalLM,
    "BitNetForCausalLM": BitNetForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeSharedForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "GraniteSWAForCausalLM": GraniteSWAForCausalLM,
    "GraniteMoeSWAForCausalLM": GraniteMoeSWAForCausalLM,
    "MiniCPM3ForCausalLM": MiniCPM3ForCausalLM,
    "LagunaForCausalLM": LagunaForCausalLM,
    "HYV3ForCausalLM": HYV3ForCausalLM,
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "MiMoV2FlashForCausalLM": MiMoV2FlashForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "JambaForCausalLM": JambaForCausalLM,
    # pure state-space models (models/mamba.py)
    "MambaForCausalLM": MambaForCausalLM,
    "FalconMambaForCausalLM": FalconMambaForCausalLM,
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    # Kimi Delta Attention + MLA (layers/kimi_delta_attention.py)
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM,
    "Dots1ForCausalLM": Dots1ForCausalLM,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    "PhimoeForCausalLM": PhimoeForCausalLM,
    "PhiMoEForCausalLM": PhiMoEForCausalLM,
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "SeedOssForCausalLM": SeedOssForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "Exaone4_5_ForConditionalGeneration": Exaone4_5_ForConditionalGeneration,
    "HunYuanDenseV1ForCausalLM": HunYuanDenseV1ForCausalLM,
    "HunYuanMoEV1ForCausalLM": HunYuanMoEV1ForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
    # hybrid Gated DeltaNet / gated attention (layers/gated_delta_net.py)
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": Cohere2ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "Llama4ForConditionalGeneration": Llama4ForConditionalGeneration,
    "AfmoeForCausalLM": AfmoeForCausalLM,
    "ExaoneMoeForCausalLM": ExaoneMoeForCausalLM,
    "ExaoneMoEForCausalLM": ExaoneMoEForCausalLM,  # (the released configs' spelling before 5.1)
    "SolarOpenForCausalLM": SolarOpenForCausalLM,
    "Cohere2MoeForCausalLM": Cohere2MoeForCausalLM,
    "DbrxForCausalLM": DbrxForCausalLM,
}

# Checkpoints without an LM head, served by the pooling runner with the same classes: bare base
# models (saved by `AutoModel`, e.g. embedding checkpoints; their weights get the base model's
# prefix on loading) and sequence classifiers (a `score` head; models/base.py `head_kind`).
POOLING_ALIASES: dict[str, str] = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
    "Gemma3TextModel": "Gemma3ForCausalLM",
    "OPTModel": "OPTForCausalLM",
    "GPT2Model": "GPT2LMHeadModel",
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "OPTForSequenceClassification": "OPTForCausalLM",
    "GPT2ForSequenceClassification": "GPT2LMHeadModel",
}

# For configs built in code, which carry no `architectures`.
_BY_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "ministral": "MinistralForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "mistral3": "Mistral3ForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma3n_text": "Gemma3nForCausalLM",
    "gemma3n": "Gemma3nForConditionalGeneration",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "opt": "OPTForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "olmoe": "OlmoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "phi": "PhiForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "apertus": "ApertusForCausalLM",
    "arcee": "ArceeForCausalLM",
    "helium": "HeliumForCausalLM",
    "olmo": "OlmoForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "jais2": "Jais2ForCausalLM",
    "cwm": "CwmForCausalLM",
    "vaultgemma": "VaultGemmaForCausalLM",
    "youtu": "YoutuForCausalLM",
    "apertus1p5_text": "Apertus1p5TextForCausalLM",
    "bitnet": "BitNetForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "granite_swa": "GraniteSWAForCausalLM",
    "granitemoe_swa": "GraniteMoeSWAForCausalLM",
    "minicpm3": "MiniCPM3ForCausalLM",
    "laguna": "LagunaForCausalLM",
    "hy_v3": "HYV3ForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM",
    "falcon": "FalconForCausalLM",
    "mimo_v2_flash": "MiMoV2FlashForCausalLM",
    "bamba": "BambaForCausalLM",
    "jamba": "JambaForCausalLM",
    "mamba": "MambaForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm": "GlmForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "dots1": "Dots1ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "phimoe": "PhimoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "exaone4_5": "Exaone4_5_ForConditionalGeneration",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "cohere": "CohereForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
    "afmoe": "AfmoeForCausalLM",
    "exaone_moe": "ExaoneMoeForCausalLM",
    "solar_open": "SolarOpenForCausalLM",
    "cohere2_moe": "Cohere2MoeForCausalLM",
    "dbrx": "DbrxForCausalLM",
}


def supported_architectures() -> list[str]:
    """The HF `architectures` names we can load."""
    return list(MODEL_REGISTRY)


def get_model_class(config: Any) -> type[nn.Module]:
    """Our class for `config`: the first of `config.architectures` we support (or, when the config
    names none, the one for its `model_type`). ValueError listing the supported ones otherwise."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in _BY_MODEL_TYPE:
        archs = [_BY_MODEL_TYPE[config.model_type]]
    for arch in archs:
        arch = POOLING_ALIASES.get(arch, arch)
        if arch in MODEL_REGISTRY:
            cls = MODEL_REGISTRY[arch]
            # a multimodal wrapper picks its class by the text decoder's type
            return cls.for_config(config) if hasattr(cls, "for_config") else cls
    raise ValueError(
        f"unsupported model architecture {archs or getattr(config, 'model_type', None)!r}; "
        f"supported: {', '.join(MODEL_REGISTRY)}"
    )


def context_limit(config: Any) -> int | None:
    """The longest context the model class for `config` serves exactly (a class's
    `context_limit(config)`: Llama 4's attention chunk), or None: its position limit alone."""
    limit = getattr(get_model_class(config), "context_limit", None)
    return None if limit is None else limit(config)
