"""Our Qwen2 equals HF transformers, including its sliding-window switches."""

import transformers

from pagedserve.models.qwen2 import Qwen2ForCausalLM

VOCAB = 384


def tiny_qwen2(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    return transformers.Qwen2Config(**{**base, **kw})


def test_qwen2_sliding_window_set_but_disabled(hf_pair, check_hf, prompts):
    # sliding_window is in the config but use_sliding_window=false: HF attends globally.
    hf, model, _ = hf_pair(tiny_qwen2(use_sliding_window=False, sliding_window=4, max_window_layers=0))
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert model.model.layers[0].self_attn.o_proj.bias is None
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, None]
    check_hf(hf, model, prompts(VOCAB))


def test_qwen2_sliding_window_from_max_window_layers(hf_pair, check_hf, prompts):
    hf, model, _ = hf_pair(tiny_qwen2(use_sliding_window=True, sliding_window=5, max_window_layers=1))
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, 5]
    check_hf(hf, model, prompts(VOCAB))
