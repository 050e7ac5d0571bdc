"""The embedded Gemma 3 270M: greedy continuations equal HF transformers on the same GGUF."""

import pytest

from pagedserve import SamplingParams
from utils import assert_tie_rule, hf_greedy, ours_as_pairs

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived",
]


@pytest.mark.slow
def test_embedded_greedy_continuations_match_hf_on_the_same_gguf(embedded_llm, embedded_hf_model):
    tok = embedded_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)
    outs = embedded_llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt).input_ids
        assert out.prompt_token_ids == ids and ids[0] == tok.bos_token_id
        ref = hf_greedy(embedded_hf_model, ids, 16)
        assert_tie_rule(ours_as_pairs(out.outputs[0]), ref, prompt)
    assert embedded_llm.engine.num_used_blocks() == 0


@pytest.mark.slow
def test_embedded_model_text_decodes_like_the_tokenizer(embedded_llm):
    out = embedded_llm.generate("The capital of France is", SamplingParams(max_tokens=12,
                                temperature=0.0), use_tqdm=False)[0].outputs[0]
    tok = embedded_llm.get_tokenizer()
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.text.startswith(" ")
