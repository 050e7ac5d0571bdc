"""lm-evaluation-harness against the server, as its users run it: the `local-completions` model
on a small local task (a jsonl this test writes), both `loglikelihood` (echo + logprobs of the
prompt, read with the chosen token first) and `generate_until` (stop strings)."""

import json
import math

import pytest

pytestmark = pytest.mark.timeout(600)

DOCS = [
    {"question": "The module provides", "answer": " a", "choices": [" a", " the"], "gold": 0},
    {"question": "Return the value of", "answer": " the", "choices": [" the", " it"], "gold": 0},
    {"question": "A list of", "answer": " the", "choices": [" values", " the"], "gold": 1},
    {"question": "The function returns", "answer": " a", "choices": [" a", " an"], "gold": 0},
]

LOGLIKELIHOOD_TASK = """
task: pagedserve_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
"""

GENERATE_TASK = """
task: pagedserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def test_lm_eval_local_completions_runs_loglikelihood_and_generate_until_tasks(
        server, tiny_llama, tmp_path, offline_llm):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "ll.yaml").write_text(LOGLIKELIHOOD_TASK.format(path=data))
    (tmp_path / "gen.yaml").write_text(GENERATE_TASK.format(path=data))
    results = simple_evaluate(
        model="local-completions",
        model_args={"base_url": server.url + "/v1/completions", "model": server.model,
                    "tokenizer_backend": "huggingface", "tokenizer": str(tiny_llama),
                    "num_concurrent": 2, "max_retries": 1},
        tasks=["pagedserve_ll", "pagedserve_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
    )
    ll = results["results"]["pagedserve_ll"]
    gen = results["results"]["pagedserve_gen"]
    assert 0.0 <= ll["acc,none"] <= 1.0 and 0.0 <= gen["exact_match,none"] <= 1.0
    # The log-likelihoods are the engine's own prompt logprobs of each continuation.
    from pagedserve import SamplingParams

    tok = offline_llm.get_tokenizer()
    for sample in results["samples"]["pagedserve_ll"]:
        question = sample["doc"]["question"]
        for (context, cont), ((got, _greedy),) in zip(sample["arguments"],
                                                      sample["resps"]):
            ctx_ids = tok(context, add_special_tokens=False).input_ids
            ids = tok(context + cont, add_special_tokens=False).input_ids
            assert context == question
            out = offline_llm.generate([{"prompt_token_ids": ids}], SamplingParams(
                max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)[0]
            want = sum(out.prompt_logprobs[i][ids[i]].logprob
                       for i in range(len(ctx_ids), len(ids)))
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-5)
    # Generated answers are the engine's greedy text cut at the first stop string.
    for sample in results["samples"]["pagedserve_gen"]:
        (got,) = sample["resps"][0]
        ref = offline_llm.generate([sample["doc"]["question"]], SamplingParams(
            max_tokens=8, temperature=0, stop=["\n", "."]), use_tqdm=False)[0]
        assert got == ref.outputs[0].text
