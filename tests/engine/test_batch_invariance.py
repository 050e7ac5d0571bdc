"""The stress harness's oracle rests on `batch_invariant_ops`: with them, a request's tokens and
logprobs do not depend, to the last bit, on what else is in its steps, on chunking or on the block
size (torch's own float32 CPU matmul and SDPA do: see tests/engine/batch_invariant.py)."""

import random

import pytest
import torch

from batch_invariant import batch_invariant_ops
from pagedserve import SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from stress_harness import summarize

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2,
                        ignore_eos=True)


def _run(engine, prompts, **cache):
    engine.reconfigure_cache(**cache)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, PARAMS, prompt_token_ids=p)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: summarize(o) for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def engine(checkpoints):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny Python-bound steps: threads only contend
    with batch_invariant_ops():
        yield LLMEngine(EngineArgs(model=str(checkpoints("llama")), dtype="float32",
                                   device="cpu", block_size=4, num_kv_blocks=256,
                                   max_model_len=128))
    torch.set_num_threads(threads)


def test_request_alone_in_a_crowd_chunked_or_in_blocks_of_one_gives_identical_bits(engine):
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))]
               for _ in range(5)]
    alone = [_run(engine, [p])[0] for p in prompts]
    assert _run(engine, prompts) == alone
    assert _run(engine, prompts, max_num_batched_tokens=5) == alone
    assert _run(engine, prompts, block_size=1, num_kv_blocks=512,
                max_num_batched_tokens=2048) == alone
