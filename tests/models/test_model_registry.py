"""`pagedserve.models.registry`: HF architecture names to our classes."""

import pytest
import transformers

from pagedserve.models.gemma3 import Gemma3ForCausalLM
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.registry import MODEL_REGISTRY, get_model_class, supported_architectures

EXPECTED = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MinistralForCausalLM",
    "Ministral3ForCausalLM",
    "Mistral3ForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Gemma3nForCausalLM",
    "Gemma3nForConditionalGeneration",
    "Gemma4ForCausalLM",
    "Gemma4ForConditionalGeneration",
    "OPTForCausalLM",
    "GPT2LMHeadModel",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "GemmaForCausalLM",
    "GraniteForCausalLM",
    "Glm4ForCausalLM",
    "GlmForCausalLM",
    "SmolLM3ForCausalLM",
    "SeedOssForCausalLM",
    "Exaone4ForCausalLM",
    "Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "CohereForCausalLM",
    "Cohere2ForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
}
# mixture of experts (layers/moe.py)
EXPECTED |= {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen3VLMoeForConditionalGeneration",
             "OlmoeForCausalLM",
             "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "Glm4MoeForCausalLM", "Dots1ForCausalLM",
             "Ernie4_5_MoeForCausalLM", "PhimoeForCausalLM", "PhiMoEForCausalLM",
             "Llama4ForCausalLM", "Llama4ForConditionalGeneration", "MiniMaxM2ForCausalLM"}
# Mamba2 hybrids (layers/mamba2.py)
EXPECTED |= {"GraniteMoeHybridForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM",
             "FalconH1ForCausalLM"}
# Mamba 1 hybrid (layers/mamba1.py)
EXPECTED |= {"JambaForCausalLM"}
# GLM-4.7-Flash (latent attention), ERNIE 4.5 dense, HunYuan dense / MoE
EXPECTED |= {"Glm4MoeLiteForCausalLM", "Ernie4_5ForCausalLM", "HunYuanDenseV1ForCausalLM",
             "HunYuanMoEV1ForCausalLM"}
# the older dense families (layers/residual.py, layers/mlp.py)
EXPECTED |= {"PhiForCausalLM", "StableLmForCausalLM", "Starcoder2ForCausalLM", "GPTNeoXForCausalLM",
             "ApertusForCausalLM", "ArceeForCausalLM", "HeliumForCausalLM", "OlmoForCausalLM",
             "NemotronForCausalLM"}
# pure state-space models (models/mamba.py)
EXPECTED |= {"MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM"}
# Kimi Delta Attention + MLA (layers/kimi_delta_attention.py)
EXPECTED |= {"KimiLinearForCausalLM"}
# more MoE families (AfMoE, ...)
EXPECTED |= {"AfmoeForCausalLM", "ExaoneMoeForCausalLM", "ExaoneMoEForCausalLM", "SolarOpenForCausalLM",
             "Cohere2MoeForCausalLM", "DbrxForCausalLM"}
EXPECTED |= {"Jais2ForCausalLM", "Exaone4_5_ForConditionalGeneration", "CwmForCausalLM",
             "VaultGemmaForCausalLM", "YoutuForCausalLM", "Apertus1p5TextForCausalLM",
             "BitNetForCausalLM"}  # (densec)
# Granite with sliding windows and sinks (models/granite_swa.py)
EXPECTED |= {"GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM"}
# MiniCPM3: dense, MLA (models/minicpm3.py)
EXPECTED |= {"MiniCPM3ForCausalLM"}
# Laguna: gated per-layer-width attention, sigmoid-routed experts (models/laguna.py)
EXPECTED |= {"LagunaForCausalLM"}
# HunYuan V3: q/k norms, sigmoid-routed experts and a shared MLP (models/hy_v3.py)
EXPECTED |= {"HYV3ForCausalLM"}
# GPT-BigCode: multi-query, learned positions (models/gpt_bigcode.py)
EXPECTED |= {"GPTBigCodeForCausalLM"}
# Falcon with rotary positions (models/falcon.py)
EXPECTED |= {"FalconForCausalLM"}
# MiMo-V2-Flash: sliding layers with sinks, narrow value heads, DeepSeek-V3 routing (models/mimo_v2_flash.py)
EXPECTED |= {"MiMoV2FlashForCausalLM"}


def test_registry_names():
    assert set(supported_architectures()) == EXPECTED == set(MODEL_REGISTRY)
    for name, cls in MODEL_REGISTRY.items():
        assert cls.__name__ == name
        assert cls.__doc__


def test_get_model_class_by_architectures_or_model_type():
    config = transformers.LlamaConfig(architectures=["SomethingElse", "LlamaForCausalLM"])
    assert get_model_class(config) is LlamaForCausalLM
    assert get_model_class(transformers.Gemma3TextConfig()) is Gemma3ForCausalLM  # no architectures
    from pagedserve.models.llama4 import Llama4ForCausalLM, Llama4ForConditionalGeneration

    assert get_model_class(transformers.Llama4TextConfig()) is Llama4ForCausalLM
    assert get_model_class(transformers.Llama4Config()) is Llama4ForConditionalGeneration


def test_unsupported_architecture_lists_supported_ones():
    config = transformers.BertConfig(architectures=["BertForMaskedLM"])
    with pytest.raises(ValueError) as err:
        get_model_class(config)
    message = str(err.value)
    assert "BertForMaskedLM" in message
    assert all(name in message for name in EXPECTED)


def test_pooling_checkpoints_load_into_the_generation_classes():
    # Bare base models and sequence classifiers (the pooling runner's) map onto our classes.
    from pagedserve.models.registry import POOLING_ALIASES

    for name, target in POOLING_ALIASES.items():
        config = transformers.LlamaConfig(architectures=[name])
        assert get_model_class(config) is MODEL_REGISTRY[target]
