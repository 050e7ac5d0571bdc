"""Our OPT equals HF transformers: position offset 2, pre/post layer norm, project_in/out."""

import pytest
import transformers

from pagedserve.models.opt import OPTForCausalLM

VOCAB = 400


@pytest.mark.parametrize(
    "pre_norm, proj_dim",
    [(True, 64), (False, 32)],  # 125m-style; 350m-style (post-norm, word_embed_proj_dim != hidden_size)
)
def test_opt_matches_hf(hf_pair, check_hf, prompts, pre_norm, proj_dim):
    config = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        do_layer_norm_before=pre_norm,
        word_embed_proj_dim=proj_dim,
        pad_token_id=1,
    )
    hf, model, _ = hf_pair(config, std=0.15)
    assert isinstance(model, OPTForCausalLM)
    decoder = model.model.decoder
    assert (decoder.project_in is None) == (proj_dim == 64)
    assert (decoder.final_layer_norm is None) == (not pre_norm)
    assert decoder.embed_positions.weight.shape[0] == 32 + 2
    check_hf(hf, model, prompts(VOCAB))


def test_opt_loads_original_checkpoint_names(hf_pair, prompts, paged_runner):
    """facebook/opt-* checkpoints name tensors `decoder.*` (no `model.` prefix)."""
    config = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=32,
    )
    hf, model, _ = hf_pair(config)
    from pagedserve.models.loader import load_model

    bare = [(name.removeprefix("model."), t) for name, t in hf.state_dict().items() if name != "lm_head.weight"]
    other = load_model(config, weights=bare, dtype=model.lm_head.weight.dtype)
    p = prompts(VOCAB, lengths=(7,))
    (a,) = paged_runner(model).step([(0, p[0])])
    (b,) = paged_runner(other).step([(0, p[0])])
    assert (a == b).all()
