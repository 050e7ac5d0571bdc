"""Speculative decoding on the server: its counters on /metrics under vLLM's names (and the
`--metrics-prefix` chosen), beam search refused with a 400, the flag parsed from the CLI."""

import pytest

from app_utils import run_app
from server_utils import metric

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'


@pytest.fixture(scope="module")
def engine(checkpoints):
    from pagedserve import LLMEngine
    from pagedserve.config import EngineArgs

    return LLMEngine(EngineArgs(model=str(checkpoints("llama")), dtype="float32",
                                num_kv_blocks=256, max_model_len=512, speculative_config=SPEC))


def test_spec_decode_counters_on_metrics_under_vllm_names(engine):
    # Almost every token occurs in the prompt: whatever comes next has an earlier occurrence.
    prompt = list(range(3, 400))

    async def main(client):
        r = await client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        beam = await client.post("/v1/completions", json={
            "prompt": [5, 6, 7], "max_tokens": 4, "n": 2, "use_beam_search": True,
            "temperature": 0})
        return (await client.get("/metrics")).text, beam

    text, beam = run_app(engine, main, metrics_prefix="vllm")
    drafts = metric(text, "vllm:spec_decode_num_drafts_total")
    tokens = metric(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts == engine.spec.num_drafts > 0
    assert tokens == engine.spec.num_draft_tokens >= accepted == engine.spec.num_accepted_tokens
    rate = metric(text, "vllm:spec_decode_acceptance_rate")
    assert rate == pytest.approx(accepted / tokens)
    assert 0 <= metric(text, "vllm:spec_decode_draft_time_share") < 1
    assert beam.status_code == 400 and "speculative" in beam.text
    assert engine.num_used_blocks() == 0


def test_the_speculative_config_flag_is_parsed_and_checked():
    import argparse

    from pagedserve.config import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_namespace(parser.parse_args(["--speculative-config", SPEC]))
    assert args.speculative_config == SPEC
    with pytest.raises(ValueError, match="speculative_config.num_speculative_tokens"):
        EngineArgs(speculative_config={"num_speculative_tokens": -1})
