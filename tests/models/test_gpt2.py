"""Our GPT-2 equals HF transformers (Conv1D weights transposed on load, fused c_attn)."""

import pytest
import torch
import transformers

from pagedserve.models.gpt2 import GPT2LMHeadModel
from pagedserve.models.loader import load_model

VOCAB = 320


def tiny_gpt2(**kw):
    return transformers.GPT2Config(
        **{**dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32), **kw}
    )


@pytest.mark.parametrize("inverse_layer_scale", [False, True])
def test_gpt2_matches_hf(hf_pair, check_hf, prompts, inverse_layer_scale):
    hf, model, _ = hf_pair(tiny_gpt2(scale_attn_by_inverse_layer_idx=inverse_layer_scale), std=0.15)
    assert isinstance(model, GPT2LMHeadModel)
    # HF Conv1D stores [in, out]; our Linear holds [out, in].
    hf_w = hf.transformer.h[0].attn.c_attn.weight
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight, hf_w.t())
    check_hf(hf, model, prompts(VOCAB))


def test_gpt2_original_checkpoint_names_and_mask_buffers(hf_pair):
    """openai-community/gpt2 names tensors without `transformer.` and stores `h.N.attn.bias` masks."""
    hf, model, _ = hf_pair(tiny_gpt2(n_layer=1))
    weights = [(n.removeprefix("transformer."), t) for n, t in hf.state_dict().items() if n != "lm_head.weight"]
    weights.append(("h.0.attn.bias", torch.ones(1, 1, 32, 32)))
    other = load_model(hf.config, weights=weights, dtype=torch.float32)
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
