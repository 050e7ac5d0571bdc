"""Our OLMo 3 (OLMo 2's layers, three sliding-window layers to a full one, RoPE per layer type:
YaRN on the full layers only) equals HF transformers in float32."""

import pytest
import transformers

from pagedserve.models.olmo3 import Olmo3ForCausalLM

VOCAB = 300


def olmo3_config(**overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, sliding_window=4,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                            "original_max_position_embeddings": 32}},
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Olmo3Config(**kwargs)


@pytest.mark.parametrize("types", [None, ["sliding_attention", "full_attention"] * 2],
                         ids=["default-types", "alternating"])
def test_olmo3_windows_and_per_type_rope_match_hf(hf_pair, check_hf, prompts, types):
    config = olmo3_config(**({"layer_types": types} if types else {}))
    hf, model, _ = hf_pair(config)
    assert isinstance(model, Olmo3ForCausalLM)
    want = types or ["sliding_attention"] * 3 + ["full_attention"]
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == \
        [4 if t == "sliding_attention" else None for t in want]
    assert set(model.model.rotary_emb) == {"sliding_attention", "full_attention"}
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_olmo3_from_gguf_as_llama_cpp_writes_it(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp writes OLMo 3 as "olmo2" with `attention.sliding_window` and its pattern, the full
    layers' YaRN as the rope scaling and the sliding layers' base as `rope.freq_base_swa`: it
    loads back as OLMo 3 and equals the HF run."""
    from test_gguf_dense_families import _load, write_family_gguf

    hf, _, _ = hf_pair(olmo3_config(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 20000.0,
                           "original_max_position_embeddings": 32}}))
    path = write_family_gguf(tmp_path / "olmo3.gguf", "olmo2", hf)
    config, model = _load(path, tmp_path)
    assert type(model) is Olmo3ForCausalLM and config.sliding_window == 4
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
