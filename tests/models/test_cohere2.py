"""Our Cohere 2 (Command R7B / Command A: Cohere's parallel block with sliding-window layers that
alone apply RoPE, full-attention layers without positions) equals HF transformers in float32."""

import pytest
import transformers

from pagedserve.core.kv_spec import FullAttentionSpec, SlidingWindowSpec
from pagedserve.models.cohere2 import Cohere2ForCausalLM

VOCAB = 300


def cohere2_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  sliding_window=4, logit_scale=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Cohere2Config(**kwargs)


def _older_style(pattern: int):
    """config.json as older Cohere 2 checkpoints write it: `sliding_window_pattern`, no
    `layer_types`."""

    def edit(d: dict) -> dict:
        d.pop("layer_types", None)
        return {**d, "sliding_window_pattern": pattern}

    return edit


@pytest.mark.parametrize("types,edit", [
    (["sliding_attention"] * 3 + ["full_attention"], None),
    (["sliding_attention", "full_attention"] * 2, _older_style(2)),
], ids=["default-types", "pattern-2"])
def test_cohere2_windows_and_rope_on_sliding_layers_only_match_hf(hf_pair, check_hf, prompts, types, edit):
    hf, model, _ = hf_pair(cohere2_config(), edit_config=edit)
    assert isinstance(model, Cohere2ForCausalLM)
    assert list(hf.config.layer_types) == types
    layers = model.model.layers
    sliding = [t == "sliding_attention" for t in types]
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [4 if s else None for s in sliding]
    assert [layer.self_attn.use_rope for layer in layers] == sliding
    assert all(layer.self_attn.q_norm is None for layer in layers)
    # NOTE: the engine keeps only the window's KV on the sliding layers: their own cache group
    specs = model.kv_cache_spec.layer_specs()
    assert [type(s) for s in specs] == [SlidingWindowSpec if s else FullAttentionSpec for s in sliding]
    assert all(s.window == 4 for s in specs if isinstance(s, SlidingWindowSpec))
    # prompts several windows long
    check_hf(hf, model, prompts(VOCAB, lengths=(17, 5, 11)))


def test_cohere2_from_gguf_with_a_window_pattern(hf_pair, check_hf, prompts, tmp_path):
    """llama.cpp's "cohere2" with `attention.sliding_window_pattern` flags (llama.cpp reads them;
    without, its default period 4, as tests/models/test_gguf_dense_families.py checks): the layer
    types come back and the run equals HF's."""
    from test_gguf_dense_families import _load, write_family_gguf

    types = ["sliding_attention", "full_attention"] * 2
    hf, _, _ = hf_pair(cohere2_config(layer_types=types))
    path = write_family_gguf(tmp_path / "cohere2.gguf", "cohere2", hf)
    config, model = _load(path, tmp_path)
    assert type(model) is Cohere2ForCausalLM
    assert list(config.layer_types) == types and config.sliding_window == 4 and config.logit_scale == 0.5
    check_hf(hf, model, prompts(VOCAB, lengths=(17, 5, 11)))
