"""Our Apertus 1.5 text model (Apertus with a pruned LM head: `output_vocab_size` rows, the other
ids -inf) equals HF transformers in float32."""

import pytest
import torch
import transformers

from pagedserve.models.apertus1p5 import Apertus1p5TextForCausalLM

VOCAB = 300


def apertus1p5_config(**overrides):
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, rope_parameters={
                      "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                      "original_max_position_embeddings": 16, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    kwargs.update(overrides)
    return transformers.Apertus1p5TextConfig(**kwargs)


def _distinct_xielu(hf):  # each layer's scalars its own (HF initializes them all alike)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            layer.mlp.act_fn.beta.fill_(0.3 + 0.2 * i)
            layer.mlp.act_fn.eps.fill_(-0.05 * (i + 1))


@pytest.mark.parametrize("rows", [240, None], ids=["pruned-head", "whole-head"])
def test_apertus1p5_matches_hf(hf_pair, check_hf, prompts, rows):
    hf, model, _ = hf_pair(apertus1p5_config(output_vocab_size=rows), prepare=_distinct_xielu)
    assert isinstance(model, Apertus1p5TextForCausalLM)
    assert model.lm_head.weight.shape[0] == (rows or VOCAB)
    hidden = torch.randn(3, 64)
    logits = model.compute_logits(hidden)  # [3, VOCAB]: the pruned ids -inf
    assert logits.shape == (3, VOCAB)
    if rows:
        assert torch.isneginf(logits[:, rows:]).all() and torch.isfinite(logits[:, :rows]).all()
        greedy = model.greedy_tokens(hidden)  # (None: the caller takes the logits' argmax)
        assert greedy is None or torch.equal(greedy, logits.argmax(-1))
        full = type(model).compute_logits
        model.compute_logits = lambda h: full(model, h)[:, :rows]  # (HF's logits: its head's rows)
    check_hf(hf, model, prompts(VOCAB, lengths=(13, 5, 9)))


def test_apertus1p5_refuses_a_tied_pruned_head():
    with pytest.raises(ValueError, match="output_vocab_size"):
        Apertus1p5TextForCausalLM(apertus1p5_config(output_vocab_size=240, tie_word_embeddings=True))
