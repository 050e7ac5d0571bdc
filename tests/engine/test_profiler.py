"""`--profile`: the per-section step timings of `bench throughput` / `bench serve`."""

import pytest

from pagedserve.engine.profiler import SECTIONS, StepProfiler
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def llm(checkpoints):
    llm = LLM(str(checkpoints("llama")), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    yield llm
    llm.engine.shutdown()


def _run(llm, n=3, max_tokens=6):
    prompts = [{"prompt_token_ids": [5 + i, 9, 13, 17, 21, 25 + i]} for i in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_profile_splits_steps_into_sections_that_add_up_and_counts_tokens(llm):
    prof = StepProfiler().attach(llm.engine)
    try:
        _run(llm)
    finally:
        prof.detach()
    all_steps, decode = prof.kinds["all"], prof.kinds["decode"]
    assert all_steps["steps"] == prof.kinds["mixed"]["steps"] + decode["steps"]
    # 3 prompts of 6 tokens, then 5 decode steps of 3 tokens (the 6th token comes from prefill).
    assert all_steps["tokens"] == 3 * 6 + 5 * 3 and decode["tokens"] == 5 * 3
    parts = prof.breakdown("all", wall_s=all_steps["step"] + 1.0)
    assert set(SECTIONS) <= set(parts) and parts["outside steps"] == pytest.approx(1.0)
    for name in ("schedule", "prepare inputs", "attention", "forward (rest)", "lm head",
                 "sampling", "detokenize"):
        assert parts[name] > 0, name
    inside = sum(v for k, v in parts.items() if k != "outside steps")
    assert inside == pytest.approx(all_steps["step"], rel=0.05)
    report = prof.report()
    assert "decode-only steps" in report and "engine Python" in report


def test_detach_restores_the_engine_and_outputs_are_unchanged(llm):
    before = _run(llm)
    prof = StepProfiler().attach(llm.engine)
    during = _run(llm)
    prof.detach()
    assert during == before == _run(llm)
    assert "step" not in vars(llm.engine) and type(llm.engine).step is LLMEngine.step
    runner = llm.engine.executor.runner
    assert "execute" not in vars(runner) and "compute_logits" not in vars(runner.model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in runner.model.modules())


def test_profile_needs_the_model_in_process():
    class Remote:
        executor = object()

    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        StepProfiler().attach(Remote())


def test_the_ceiling_report_of_a_model_without_plain_linear_weights_says_not_measured():
    """`bench throughput --profile` on the embedded GGUF model (every weight quantized) ends with
    a line, not a ValueError."""
    import torch

    from pagedserve.engine.profiler import ceiling_report

    assert "not measured" in ceiling_report(torch.nn.Sequential(torch.nn.ReLU()), 8, 0.01)
    assert "GFLOP/s" in ceiling_report(torch.nn.Linear(16, 16), 8, 0.01)
