"""Helpers shared by tests: the HF greedy reference and vLLM's tie rule for comparing greedy runs."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, k: int = 5):
    """Greedy tokens of HF `generate` for one prompt, and per position the top-k raw logprobs
    (dict token -> logprob, the chosen token included)."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = []
    for step, tok in zip(out.logits, tokens):
        lp = torch.log_softmax(step[0].float(), dim=-1)
        vals, idx = torch.topk(lp, k)
        entry = dict(zip(idx.tolist(), vals.tolist()))
        entry[tok] = float(lp[tok])
        logprobs.append(entry)
    return tokens, logprobs


def ours_as_pairs(completion) -> tuple[list[int], list[dict[int, float]]]:
    """(tokens, per-position {token: logprob}) of a pagedserve CompletionOutput."""
    return list(completion.token_ids), [
        {t: lp.logprob for t, lp in pos.items()} for pos in (completion.logprobs or [])
    ]


def assert_tie_rule(ours, ref, name: str = "") -> None:
    """vLLM's rule: equal tokens up to the first difference; there, each side's token must be in
    the other's top-k logprobs, and the comparison stops."""
    (a_tok, a_lp), (b_tok, b_lp) = ours, ref
    for i, (x, y) in enumerate(zip(a_tok, b_tok)):
        if x == y:
            continue
        assert x in b_lp[i] and y in a_lp[i], (
            f"{name}: position {i}: ours {x} vs reference {y} is not a near-tie\n"
            f"ours {a_tok}\nref  {b_tok}"
        )
        return
    assert len(a_tok) == len(b_tok), f"{name}: lengths differ: {len(a_tok)} vs {len(b_tok)}"
