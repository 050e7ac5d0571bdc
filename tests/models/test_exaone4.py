"""Our EXAONE 4.0 (post-norms, per-head q/k norms; hybrid: sliding layers with RoPE, global layers
without) equals HF transformers in float32."""

import pytest
import transformers

from pagedserve.models.exaone4 import Exaone4ForCausalLM

VOCAB = 300


def exaone4_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  sliding_window=4, sliding_window_pattern=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return transformers.Exaone4Config(**kwargs)


@pytest.mark.parametrize("window", [4, None], ids=["hybrid", "global"])
def test_exaone4_matches_hf(hf_pair, check_hf, prompts, window):
    # (HF's config divides by the pattern it zeroes without a window: name the types then)
    extra = {} if window else {"layer_types": ["full_attention"] * 4}
    hf, model, _ = hf_pair(exaone4_config(sliding_window=window, **extra))
    assert isinstance(model, Exaone4ForCausalLM)
    windows = [layer.self_attn.attn.sliding_window for layer in model.model.layers]
    assert windows == ([4, 4, 4, None] if window else [None] * 4)
    assert model.model.use_rope == ([True, True, True, False] if window else [True] * 4)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))
