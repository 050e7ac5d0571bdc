"""A tiny Llama that writes one given text: `make_chain_checkpoint(path, prompt_tail, text)`.

Its attention and MLP outputs are zero, so the logits at a position depend on that position's
token only (a bigram model); its LM head makes each token of a chain predict the next: the last
token of `prompt_tail` -> the tokens of `text` -> EOS. Greedy decoding after a prompt ending in
`prompt_tail` writes `text` exactly, through the real engine, with no logit tricks; a grammar or
a bias can still steer it (the steered tokens then continue at random). The chain's tokens must
be distinct (a bigram model cannot branch). The tokenizer is the tests' tiny BPE with
``<think>`` and ``</think>`` added as single (non-special) tokens, as Qwen3's and DeepSeek-R1's
tokenizers have them."""

from __future__ import annotations

from pathlib import Path

import torch

import tiny

THINK_TAGS = ["<think>", "</think>"]


def think_tokenizer():
    import copy

    tok = copy.deepcopy(tiny.tokenizer())
    tok.add_tokens(THINK_TAGS)
    return tok


def chain_ids(tok, prompt_tail: str, text: str) -> list[int]:
    """[last prompt token, the text's tokens..., EOS]; ValueError if a token repeats."""
    last = tok(prompt_tail, add_special_tokens=False).input_ids[-1]
    ids = [last, *tok(text, add_special_tokens=False).input_ids, tok.eos_token_id]
    if len(set(ids)) != len(ids):
        raise ValueError(f"the chain of {text!r} repeats a token: {ids}")
    return ids


def make_chain_checkpoint(path: Path, prompt_tail: str, text: str, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    tok = think_tokenizer()
    ids = chain_ids(tok, prompt_tail, text)
    cfg = tiny.config_for("llama", tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        model.model.norm.weight.fill_(1.0)
        head = model.lm_head.weight
        head.normal_(0.0, 0.01)
        for t, s in zip(ids, ids[1:]):
            head[s] += 10.0 * emb[t] / emb[t].norm()
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
